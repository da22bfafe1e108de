"""A finished request's blocks taken by the very next step (``turn-over``).

A second tier that stores asynchronously reads a block some time after the
step that completed it.  vLLM's offloading connector submits a step's store
jobs with the next step and copies them while that step runs; when a
request finishes, its blocks are freed at once, and the blocks its pending
stores still read are fenced (``deferred_fence_block_ids``): a step that
allocates one again waits for the store first (``jobs_to_flush``).  Without
the fence, the copy reads what the block's new owner wrote and the tier
keeps it under the finished request's key (vllm#42959's family).  An LRU
free queue hands a just-freed block out last, so the history needs a pool
turned over in one step: a request that holds its blocks decodes, and long
ones arrive beside it, more than the pool holds, so that each waits for what
the one before frees (the ``wait`` rule's licence: each alone fits, and the
one they wait beside needs nothing more once running).  Whatever
the tier's design, it must hold no other bytes under the finished request's
keys (the host listings are judged against the store,
:func:`conformance.judge.invariants.check_host_view`); the counter
``finished_blocks_retaken`` (:class:`conformance.judge.reach_coverage.ReachCoverage`)
says, from memory, that the next step did overwrite such a block.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from conformance.generate.budget import blocks_for
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Drain, Step, Submit


class Turnover(MachineBase):
    """The ``turn-over`` history (see the module's docstring)."""

    @configured_rule(precondition=lambda self: self.enabled("turn-over") and self.session is not None
                     and "turn-over" not in self.built,
                     seed=lambda c: st.integers(0, 2**32 - 1), fewer=lambda c: st.integers(0, 1))
    def finish_then_turn_over(self, seed, fewer):
        """Q, ``fewer`` blocks short of the longest sequence less one block,
        its decode of three tokens inside its last block, prefills; then R
        (whole blocks, one block short of the longest, or fewer where that
        does not fit beside Q; one token) and S (the longest prompt that fits
        alone; one token) arrive together, and T (as S) once R is done.  S
        beside Q and R is beyond what the generator's budget admits, on
        purpose: where the pool cannot hold it, S waits and is admitted on
        what R freed, in the step right after R finished, and T on what S
        frees.  A pair arrives together only where the two alone fit the pool
        together (else the second once the first is done), and Q needs
        nothing more once running and finishes, so a cache that allocates a
        block a step without preempting still serves them all.  Once they are
        done, R is asked again: what the tiers kept of it serves it (its last
        boundary's state, R being whole blocks).  Once an example: the
        check's other histories keep their share of its steps."""
        self.built.add("turn-over")
        if self.busy():
            self.apply(Drain(1024))
        rng, B, L = random.Random(seed), self.B, self.max_len
        q_len, r_len = (L // B - 1 - fewer) * B - 3, (L // B - 1) * B
        if B < 4 or q_len < 2 * B or not self.fits(q_len, 3) or not self.fits(r_len, 1):
            return
        vocab = self.model.config.vocab_size
        fresh = lambda n: tuple(rng.randrange(vocab) for _ in range(n))  # noqa: E731
        q = self.new_id()
        self.apply(Submit(q, fresh(q_len), 3))
        tracks = self.session.tracks
        for _ in range(L + 2):  # Q's prefill (a cache may run it a block a step)
            if tracks[q].done or (tracks[q].computed or 0) >= q_len:
                break
            self.apply(Step(2 * L))
        if tracks[q].done:
            return
        while r_len > 2 * B and not self.fits(r_len, 1):  # beside Q (a window model's groups take more)
            r_len -= B
        r = fresh(r_len)
        longest = self.longest_alone()  # each alone within the pool (a --kv-blocks override may shrink it)
        if longest < 2 * B:
            return
        s_, t_ = fresh(longest), fresh(longest)
        rid, sid = self.new_id(), self.new_id()
        self.apply(Submit(rid, r, 1))
        # S beside R, beyond the budget beside Q, where R and S alone fit the pool together: while Q
        # (which needs nothing more) holds its blocks, S waits for what R frees
        if not self._pair_fits(r, s_):
            self._until_done(rid)
        self.apply(Submit(sid, s_, 1))
        self._until_done(rid)
        if not self._pair_fits(s_, t_):
            self._until_done(sid)
        self.apply(Submit(self.new_id(), t_, 1))
        self.apply(Drain(1024))
        if self.fits(r_len, 1):
            self.apply(Submit(self.new_id(), r, 1))
            self.apply(Drain(1024))

    def _pair_fits(self, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        """Two one-token prompts fit the pool together, as :meth:`fits` counts blocks."""
        groups = 1 + len(self.session.memory.windows)
        return (blocks_for(len(a), 1, self.B) + blocks_for(len(b), 1, self.B)) * groups <= \
            self.impl_config.num_kv_blocks

    def _until_done(self, rid: str) -> None:
        for _ in range(self.max_len + 2):
            if self.session.tracks[rid].done:
                return
            self.apply(Step(2 * self.max_len))
