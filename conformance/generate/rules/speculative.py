"""Speculative decoding, drawn by Hypothesis (rule group ``spec``; the check
runs with the implementation's speculative decoding on, its ``spec_option``).

The harness is the drafter: a rule proposes ``count`` drafts for a request in
decode, of which the first ``agree`` are the reference's next tokens
(:class:`~conformance.harness.ops.Draft`), and steps; the draws cover draft
lengths 0..k and acceptance 0..k, a step without drafts right after one that
accepted, drafts across a block boundary (the positions fall where they fall:
k up to 3 against 4-token blocks), a prefix hit on a sequence speculation
produced, aborts with drafts in flight, verification while a distinct prompt
evicts, and verification beside another request's chunked prefill.  Their
coverage is counted by :class:`conformance.judge.spec_decode.SpecCoverage`.

Those draws meet each outcome at some seeds only (about one verification an
example; at seed 3 vLLM's EAGLE variants met no partial acceptance in 25
examples, at seed 1 no hit after one), so one rule, once an example
(``spec-walk``), builds every outcome in one request: drafts wholly
accepted, a step without drafts, partly accepted, all rejected, then a
prompt that hits past the accepted ones.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Abort, Draft, Drain, Step, Submit

_DRAFTS: dict[str, Any] = dict(which=lambda c: st.integers(0, 7), count=lambda c: st.integers(0, 3),
               agree=lambda c: st.integers(0, 3))


def _speculating(self) -> bool:
    return self.enabled("spec") and self.busy() and self.session.speculator.declared is not None


class Speculative(MachineBase):
    """Verification steps under the generator's control (see the module docstring)."""

    def _ready(self) -> list[str]:
        spec, tracks = self.session.speculator, self.session.tracks
        return [r for r in self.session.active() if spec.ready(tracks[r])]

    def _until_ready(self, steps: int = 6) -> list[str]:
        """Requests in decode, stepping (at most ``steps``) until there is one."""
        for _ in range(steps):
            ready = self._ready()
            if ready or not self.busy():
                return ready
            self.apply(Step(1024))
        return self._ready()

    def _draft(self, which: int, count: int, agree: int) -> str | None:
        ready = self._until_ready()
        if not ready:
            return None
        rid = ready[which % len(ready)]
        self.apply(Draft(rid, count, agree))
        return rid

    def _verify(self, rid: str, budget: int = 1024) -> None:
        self.apply(Step(budget))
        self.verified.extend(self.session.speculator.last.values())

    @property
    def verified(self) -> list:
        """The verifications of this example's rules (harness records, by the oracle's acceptance)."""
        return self.__dict__.setdefault("_verified", [])

    @configured_rule(precondition=_speculating, follow=lambda c: st.booleans(), **_DRAFTS)
    def verify(self, which, count, agree, follow):
        """Drafts for a request in decode, verified in the next step; then,
        drawn, a step without drafts (the accepted column must carry on)."""
        rid = self._draft(which, count, agree)
        if rid is None:
            return
        self._verify(rid)
        if follow and rid in self.session.active():
            self.apply(Step(1024))

    @configured_rule(precondition=_speculating, after=lambda c: st.booleans(), **_DRAFTS)
    def abort_verifying(self, which, count, agree, after):
        """The client goes away with drafts proposed, or right after the step
        that verified them."""
        rid = self._draft(which, max(1, count), agree)
        if rid is None:
            return
        if after:
            self._verify(rid)
        if rid in self.session.active():
            self.apply(Abort(rid))

    @configured_rule(precondition=_speculating,
                     prompt=lambda c: strategies.tokens(c.vocab, max(3 * c.B, min(c.max_len, c.num_kv_blocks // 2
                                                                                   * c.B) - 1)),
                     **_DRAFTS)
    def verify_under_pressure(self, prompt, which, count, agree):
        """A long distinct prompt arrives with the verification step: its
        allocations (and the drafts' state slots) evict while drafts are
        verified."""
        rid = self._draft(which, count, agree)
        if rid is None:
            return
        track = self.session.tracks[rid]
        distinct = tuple((t + 1 + len(track.tokens)) % self.model.config.vocab_size for t in prompt)
        if self.fits(len(distinct), 1):
            self.apply(Submit(self.new_id(), distinct, 1))
        self._verify(rid)

    @configured_rule(precondition=_speculating, base=lambda c: st.integers(0, 2),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     extra=lambda c: st.sampled_from(sorted({1, 2, c.B - 1, c.B + 1, c.B + 2} - {0})), **_DRAFTS)
    def verify_beside_prefill(self, base, cut, extra, which, count, agree):
        """A new prompt arrives as drafts are verified (at least one: no
        drafts, no verification), under a budget that leaves it a chunk
        ending before its prompt does: ``extra`` tokens, sub-block (1, 2,
        B - 1) for a cache that ends a chunk anywhere, a block and more
        (B + 1, B + 2) for one that ends a mid-prompt chunk only on a block
        boundary (vLLM's align mode rounds the sub-block ones down to
        nothing, scheduler.py ``_mamba_block_aligned_split``)."""
        rid = self._draft(which, max(1, count), agree)
        if rid is None:
            return
        prompt = self.bases[base][: max(cut, 2 * self.B + 1)]
        new = None
        if self.fits(len(prompt), 1):
            new = self.new_id()
            self.apply(Submit(new, prompt, 1))
        self._verify(rid, budget=1 + count + extra)
        # Where the new prompt got no chunk that stops inside it, once more with a prompt no hit
        # can shorten and a block and more left to it: a cache that ends a mid-prompt chunk only
        # on a block boundary rounds a sub-block ``extra`` down to nothing, and a prompt whose
        # prefix is cached may fit whole in what the drafts leave (vLLM 0.33.0's EAGLE and ngram
        # variants at seed 2: the rule drawn twice in 25 examples, its prompt scheduled whole once,
        # verify_beside_chunked_prefill 0).  Draws are unchanged where the first try reached it.
        tracks = self.session.tracks
        if new is None or tracks[new].computed not in (None, tracks[new].prompt_len):
            return
        if rid not in self._ready():
            return
        track = tracks[rid]
        distinct = tuple((t + 2 + len(track.tokens)) % self.model.config.vocab_size
                         for t in self.bases[(base + 1) % len(self.bases)][: 2 * self.B + 2])
        if self.fits(len(distinct), 1):
            self.apply(Draft(rid, max(1, count), agree))
            self.apply(Submit(self.new_id(), distinct, 1))
            self._verify(rid, budget=1 + max(1, count) + self.B + 1)

    @configured_rule(precondition=lambda self: self.enabled("spec") and self.session is not None
                     and self.session.speculator.declared is not None and "spec-walk" not in self.built,
                     base=lambda c: st.integers(0, 2),
                     blocks=lambda c: st.integers(2, max(2, c.spec.max_prompt_blocks)),
                     offset=lambda c: st.integers(1, max(1, c.B - 1)), suffix=lambda c: strategies.tokens(c.vocab, 1))
    def verify_each_outcome(self, base, blocks, offset, suffix):
        """Every outcome of a verification in one request, once an example:
        a prompt ending inside a block decodes with drafts wholly accepted,
        then a step without drafts, then drafts partly accepted (one of
        them), then all rejected, and runs to its end with drafts wholly
        accepted (its sequence ends inside them); then a prompt that
        shares its sequence past the accepted drafts hits it
        (:meth:`reuse_verified`).  The whole acceptance comes first, so that
        the sequence goes on past the next block boundary (and the block a
        declared ``hit_drop`` gives back) before it ends."""
        self.built.add("spec-walk")
        if self.busy():
            self.apply(Drain(1024))
        declared = self.session.speculator.declared
        if declared is None:  # the precondition's; kept for the type checker
            return
        k = min(3, declared.max_drafts)
        prompt = self.bases[base][: blocks * self.B + offset]
        max_new = self.spec.max_new_tokens
        if len(prompt) < 2 or not self.fits(len(prompt), max_new):
            return
        walked = self._walk(prompt, max_new, k)
        if walked and not self._kept_inside_drafts(walked) and self.fits(len(prompt), max_new):
            # nothing cached inside the accepted drafts: under second-hit admission a checkpoint
            # there needs a second sighting, and the same prompt decodes the same tokens (the
            # reference under admission second-hit, seed 0: snapshots_after_verify stayed at 0)
            self._walk(prompt, max_new, k)
        if any(v.accepted for v in self.verified):
            self.reuse_verified(0, 0, suffix, 1)

    def _walk(self, prompt, max_new: int, k: int) -> list:
        """One request through every outcome, then to its end with drafts
        wholly accepted: the last verification finishes it inside its
        accepted drafts, where a cache that keeps sequence ends only
        (retention interval 0) keeps a state (the reference under interval 0
        at seed 6: snapshots_after_verify stayed at 0).  Its verifications."""
        rid = self.new_id()
        self.apply(Submit(rid, prompt, max_new))
        before = len(self.verified)
        for count, agree in ((k, k), (0, 0), (k, 1 if k >= 2 else 0), (k, 0)):
            if not self._until_ready():
                break
            if count:
                self.apply(Draft(rid, count, agree))
            self._verify(rid)
        for _ in range(self.spec.max_new_tokens):
            if rid not in self.session.active() or not self._until_ready():
                break
            self.apply(Draft(rid, k, k))
            self._verify(rid)
        self.apply(Drain(1024))
        return self.verified[before:]

    def _kept_inside_drafts(self, verified) -> bool:
        """The cache lists a state after a position inside accepted drafts of these verifications."""
        view = self.session.last_view
        states = {e.tokens for e in view.cached_states} if view is not None else set()
        return any((v.base + v.drafts[:i]) in states for v in verified for i in range(1, v.accepted + 1))

    @configured_rule(precondition=lambda self: self.enabled("spec") and self.session is not None
                     and any(v.accepted for v in self.verified),
                     which=lambda c: st.integers(0, 7), off=lambda c: st.integers(0, 2),
                     suffix=lambda c: strategies.tokens(c.vocab, 1), max_new=lambda c: st.integers(1, 4))
    def reuse_verified(self, which, off, suffix, max_new):
        """A prompt that shares a sequence past drafts that were accepted, up
        to the first block boundary after them where that sequence computed
        one: a prefix hit on what verification steps wrote."""
        if self.busy():  # the sequences computed whole (and cached where the policy says)
            self.apply(Drain(1024))
        # a cache whose hits give tokens back to its drafter (EAGLE's block drop,
        # declared) reuses that much less: the prompt reaches that much further
        declared = self.session.speculator.declared
        drop = declared.hit_drop if declared is not None else 0
        tracks = self.session.tracks

        def boundary(v) -> int:
            return (v.end // self.B + 1 + -(-drop // self.B)) * self.B

        candidates = [v for v in self.verified if v.accepted]
        reaching = [v for v in candidates if boundary(v) <= (tracks[v.request_id].computed or 0)]
        v = (reaching or candidates)[which % len(reaching or candidates)]
        track = tracks[v.request_id]
        cut = boundary(v) if v in reaching else v.end + v.accepted
        prompt = track.tokens[: min(cut + off, len(track.tokens))] + suffix
        if self.fits(len(prompt), max_new):
            self.apply(Submit(self.new_id(), prompt, max_new))
            self.apply(Step(1024))
