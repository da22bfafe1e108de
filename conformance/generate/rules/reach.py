"""Histories outside caches needed and the generator never built (issue 37),
one rule each, once an example (``MachineBase.built``), built whole from
what the session exposes (tracks, memory, the drafter's proposals), never
from a checker's counter.  Their coverage is counted by
:class:`conformance.judge.reach_coverage.ReachCoverage`.

- ``reconverge``: two prompts that part at their first block and continue
  with the same blocks (P1 = X + C, P2 = Y + C), then a prompt that shares
  only those blocks, at another place (C + ...): a cache that keys a block,
  or a second-hit sighting, by the block's tokens alone confuses them;
- ``wait``: a prompt of whole blocks is cached; requests that need every other
  block run; a prompt that hits the cached one arrives (beyond what the
  generator's budget admits: it waits while the pool is busy), then a
  distinct one-block prompt: a cache that matched the waiting request at
  its arrival and did not hold what it matched gives its hit's block to the
  second, and meets it overwritten when it is finally admitted;
- ``spec-edges``: a request in decode is stepped until its verification's
  last draft falls on a block's first position; its drafts (fewer than
  declared when the declaration allows: a drafter that finds fewer) are all
  rejected, while a new prompt that shares its tokens and drafts through the
  block they complete arrives in the same step; then drafts one fewer than
  declared, one accepted; then, with one token left, as many drafts as
  declared (past its last token: engines draft up to ``k`` whatever
  ``max_tokens`` leaves), so that it ends inside the verification; the new
  prompt's request verifies once and is aborted.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Abort, Draft, Drain, Step, Submit
from conformance.judge.reuse import INDEXES


def _once(group: str):
    return lambda self: self.enabled(group) and self.session is not None and group not in self.built


class Reach(MachineBase):
    """The histories of issue 37 (see the module's docstring)."""

    # -- reconverge ------------------------------------------------------------------------
    @configured_rule(precondition=_once("reconverge"), seed=lambda c: st.integers(0, 2**32 - 1),
                     head=lambda c: st.integers(1, 2), shared=lambda c: st.integers(1, 2))
    def reconverge(self, seed, head, shared):
        """P1 = X + C, P2 = Y + C (X and Y part at their first token, C whole
        blocks), each run to its end; then C and a token more (C's blocks at
        another place).  Under a second-hit policy P2's checkpoints inside C
        are first sightings whose last block was sighted before; a cache that
        matches a block by its tokens alone hits C in P2 or at the start."""
        self.built.add("reconverge")
        if self.busy():
            self.apply(Drain(1024))
        rng, B = random.Random(seed), self.B
        x = self._distinct(rng, head * B)
        y = ((x[0] + 1 + rng.randrange(self.vocab - 1)) % self.vocab,) + self._distinct(rng, head * B - 1)
        c = self._distinct(rng, shared * B)
        for prompt in (x + c, y + c, c + self._distinct(rng, 1)):
            if self.fits(len(prompt), 1):
                self.apply(Submit(self.new_id(), prompt, 1))
                self.apply(Drain(1024))

    # -- wait ------------------------------------------------------------------------------
    @configured_rule(precondition=_once("wait"), seed=lambda c: st.integers(0, 2**32 - 1))
    def wait_while_busy(self, seed):
        """A prompt C of whole blocks (one, or as many as the running ones
        leave) runs to its end (the youngest cached entry);
        distinct prompts that need every other block run (their decode step
        inside their last block, two tokens each, so that they hold what they
        took for a step after their prefill; each alone within the
        generator's budget, together beyond it); after their prefill, C and
        three blocks more arrive (no room: it waits) and a distinct one-block
        prompt (whose block an LRU takes from C).  Each alone fits, and the
        running ones need nothing more, so a correct cache serves them once
        those finish."""
        self.built.add("wait")
        if self.busy():
            self.apply(Drain(1024))
        rng, B, N = random.Random(seed), self.B, self.session.layout.num_kv_blocks
        if B < 3:
            return
        slots = self.impl_config.num_state_slots
        most = min(self.spec.max_active, slots // 2) * (self.max_len // B)  # what the running ones can hold
        c = self._distinct(rng, max(1, N - most) * B)  # C and the running ones take the whole pool
        if not self.fits(len(c), 1) or len(c) + 3 * B >= self.max_len:
            return
        self.apply(Submit(self.new_id(), c, 1))
        self.apply(Drain(1024))
        if c not in INDEXES.get(self.session.last_view, B).states:
            # C's state not listed: under second-hit admission its prompt end needs a second sighting,
            # or the waiting request hits nothing, takes C's blocks and runs at once (the reference under
            # admission second-hit, seeds 0 and 2: waits_while_busy 0)
            self.apply(Submit(self.new_id(), c, 1))
            self.apply(Drain(1024))
        room, running = N - len(c) // B, list[str]()  # every block but C's
        while room > 0 and len(running) < self.spec.max_active and 2 * (len(running) + 1) <= slots:
            b = min(room, self.max_len // B)
            prompt = self._distinct(rng, b * B - 2)  # its decode step stays inside its last block
            if b + 1 > N:  # each alone within the generator's budget (together, beyond it)
                break
            rid = self.new_id()
            self.apply(Submit(rid, prompt, 2))
            running.append(rid)
            room -= b
        if not running:
            return
        tracks = self.session.tracks
        for _ in range(self.max_len + 2):
            if all(tracks[r].done or (tracks[r].computed or 0) >= tracks[r].prompt_len for r in running):
                break
            self.apply(Step(1024))
        if any(tracks[r].done for r in running):
            return  # the pool is not busy any more
        waiting = c + self._distinct(rng, 3 * B)
        if len(waiting) < self.max_len:
            self.apply(Submit(self.new_id(), waiting, 1))
        self.apply(Submit(self.new_id(), self._distinct(rng, B), 1))
        self.apply(Drain(1024))

    # -- spec-edges ------------------------------------------------------------------------
    @configured_rule(precondition=lambda self: _once("spec")(self) and "spec-edges" not in self.built
                     and self.session.speculator.declared is not None,
                     base=lambda c: st.integers(0, 2),
                     blocks=lambda c: st.integers(1, max(1, c.spec.max_prompt_blocks - 1)),
                     offset=lambda c: st.integers(0, c.B - 1), short=lambda c: st.integers(0, 2),
                     agree=lambda c: st.integers(0, 3))
    def verify_at_the_edges(self, base, blocks, offset, short, agree):
        """See the module's docstring: rejected drafts where a draft opened a
        block, a new prompt admitted beside a verification that completes a
        block it shares, a draft count below the declared one, a request
        that ends inside a verification (``agree`` of its last drafts agree:
        rejected, or accepted past its last token), an abort after a
        verification."""
        self.built.add("spec-edges")
        if self.busy():
            self.apply(Drain(1024))
        declared = self.session.speculator.declared
        if declared is None:  # the precondition's; kept for the type checker
            return
        B, k, tracks = self.B, declared.max_drafts, self.session.tracks
        count = max(1, k - short)
        prompt = self.bases[base][: max(2, blocks * B + offset)]
        # the prefill's token, B - 1 to align, 1 and 2 verified, 1 left for the last verification; its
        # sequence then ends one token into a block (a dense policy's block-boundary checkpoint would
        # register the end state on its own path, and the end inside a block is where a cache takes it)
        max_new = B + 4 + (1 - (len(prompt) + B + 3)) % B
        if not self.fits(len(prompt), max_new):
            return
        rid = self.new_id()
        self.apply(Submit(rid, prompt, max_new))
        track = tracks[rid]
        for _ in range(self.max_len):  # in decode, the last draft of the next verification on a block's start
            self.apply(Step(1024))
            if track.done or (self.session.speculator.ready(track) and (len(track.tokens) + count - 1) % B == 0):
                break
        if not self.session.speculator.ready(track):
            return
        self.apply(Draft(rid, count, 0))
        drafts = self.session.speculator.proposals.get(rid, ())
        end = len(track.tokens)
        q = (end // B + 1) * B  # the block the drafts complete, if they reach its end
        other: str | None = None
        if drafts and q <= end + len(drafts):
            shared = (track.tokens + drafts)[:q] + (drafts[-1],)
            if self.fits(len(shared), 4):
                other = self.new_id()
                self.apply(Submit(other, shared, 4))
        self.apply(Step(1024))
        ready = self.session.speculator.ready
        for _ in range(self.max_len):  # the new prompt's request in decode
            if other is None or ready(tracks[other]) or tracks[other].done:
                break
            self.apply(Step(1024))
        if other is not None and ready(tracks[other]):
            self.apply(Draft(other, k, 1))
        if ready(track):  # one draft fewer than declared, one accepted
            self.apply(Draft(rid, max(1, k - 1), 1))
        self.apply(Step(1024))
        if other is not None and not tracks[other].done:
            self.apply(Abort(other))  # right after its verification
        for _ in range(max_new):  # with one token left, every draft it is proposed runs past its end
            if not ready(track) or track.max_new - track.generated <= 1:
                break
            self.apply(Step(1024))
        if ready(track):
            self.apply(Draft(rid, k, agree))
            self.apply(Step(1024))
        self.apply(Drain(1024))

    # -- helpers ---------------------------------------------------------------------------
    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def _distinct(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.vocab) for _ in range(n))
