"""The host tier's wire under the generator's control: loads held and decided."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.draws import (
    asked_again,
    boundary_state_alone,
    displace_boundary_state,
    junk_prompts,
    tail_against_remote,
)
from conformance.harness.ops import OUTCOMES, Abort, Deliver, Drain, Step, StoreEvict, Submit
from conformance.judge.memory_coverage import Held


class Transfers(MachineBase):
    """The host tier's wire under the generator's control (rule name
    ``transfers``; the check must run with the tier on).  Loads stay pending
    after the step that issued them; while they are pending the generator
    decides their completion (now, later, failed, short, out of order), evicts
    the host entry they are about to read, claims the same prefix with a second
    request, evicts locally, or aborts the request that waits."""

    def _loading(self) -> bool:
        return self.enabled("transfers") and self.session is not None and bool(self.session.pending_loads())

    def _losses(self) -> bool:
        """Whether the tier under test has a path for a lost load (failed, short,
        its host entry gone).  One that declares ``retention()["tier_losses"]``
        false has none by design (vLLM's OffloadingConnector over process
        memory: its worker asserts that every job succeeded), so its loads are
        decided only in time (late, out of order); the lost ones are then
        ``--faults``' to inject, against a recorded limitation."""
        session = self.session
        if getattr(self, "_losses_of", None) is not session:
            retention = getattr(session.impl, "retention", None)
            decl = session.call("retention") if callable(retention) else None
            self._losses_of, self._losses_are = session, not (isinstance(decl, dict)
                                                              and decl.get("tier_losses") is False)
        return self._losses_are

    def _fate(self, outcome: str) -> str:
        """``outcome``, or a whole delivery where the tier has no path for a loss."""
        return outcome if outcome == "ok" or self._losses() else "ok"

    @configured_rule(precondition=lambda self: self.enabled("transfers") and self.session is not None
                     and self.finished,
                     which=lambda c: st.integers(0, 7), junk=junk_prompts,
                     fates=lambda c: st.lists(st.tuples(st.integers(0, 3),
                                                        st.sampled_from(("short", "fail", "evict", "ok")),
                                                        st.integers(0, 2)), min_size=2, max_size=4))
    def reload_and_decide(self, which, junk, fates):
        """A finished prompt displaced to the host tier and asked for again;
        its loads are decided at once (outcome, delay, order; or the host
        entry evicted after the lookup)."""
        if self.session.active():  # requests are rarely all finished between rules: finish them
            self.apply(Drain(1024))
        # the longer prompts first: only what spans a block can come back from the tier, and only
        # where memory held a state at a block boundary of it (a cache that keeps prompt ends only
        # has none inside a prompt that ends inside a block)
        tracks, B = self.session.tracks, self.B
        held = Held(self.session.memory)
        longest = sorted(self.finished, key=lambda r: -tracks[r].prompt_len)
        longest = [r for r in longest if any(tracks[r].tokens[:q] in held.states
                                             for q in range(B, tracks[r].prompt_len + 1, B))] or longest
        prev = tracks[longest[which % min(2, len(longest))]]
        asked = asked_again(self.session.memory, prev)
        junk = [prompt[: self.longest_alone()] for prompt in junk]  # (the pool bounds it where it is small)
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        if self.fits(len(asked), 1):
            self.apply(Submit(self.new_id(), asked, 1))
            self.apply(Step(1))
        decided = False
        for i, (pick, outcome, delay) in enumerate(fates):
            if self.session.pending_loads():
                if i == 0 and not self.session.control.counts["store_evicted"] and self._losses():
                    # the first decision of an example that has evicted no host entry under a load yet
                    # evicts one (the controller's record, not a judge's counter): drawn one in four, it
                    # missed every pending reload of vLLM's tier-races[connector=async,prefix_match_unit=1]
                    # at seed 5, three in 25 examples
                    outcome = "evict"
                outcome = self._fate(outcome)
                self.apply(StoreEvict(pick) if outcome == "evict" else Deliver(pick, outcome, delay))
                decided = True
        if decided:
            self.apply(Step(1))  # what was decided for now happens (the delayed stay pending)

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3),
                     outcome=lambda c: st.sampled_from(OUTCOMES), delay=lambda c: st.integers(0, 2))
    def deliver(self, pick, outcome, delay):
        self.apply(Deliver(pick, self._fate(outcome), delay))

    @configured_rule(precondition=lambda self: self._loading() and self._losses(), pick=lambda c: st.integers(0, 3))
    def store_evict(self, pick):
        self.apply(StoreEvict(pick))

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3),
                     suffix=lambda c: strategies.tokens(c.vocab, 2), extra=lambda c: st.integers(0, 2))
    def claim_while_loading(self, pick, suffix, extra):
        """A second request for the prefix a load is bringing in."""
        loads = self.session.pending_loads()
        rid = loads[pick % len(loads)].request_id
        track = self.session.tracks.get(rid) if rid is not None else None
        if track is not None and self.fits(track.prompt_len + extra, 1):
            self.apply(Submit(self.new_id(), track.tokens[: track.prompt_len] + suffix[:extra], 1))

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3))
    def abort_loading(self, pick):
        loads = self.session.pending_loads()
        rid = loads[pick % len(loads)].request_id
        if rid in self.session.active():
            self.apply(Abort(rid))

    @configured_rule(precondition=lambda self: self._loading(),
                     prompt=lambda c: strategies.tokens(c.vocab, max(2 * c.B, c.num_kv_blocks // 3 * c.B - 1)))
    def evict_while_loading(self, prompt):
        """Local eviction while a load is in flight: a distinct prompt's
        allocations meet the blocks the load targets or the entries it joins."""
        prompt = prompt[: self.max_len - 1]
        if self.fits(len(prompt), 1):
            self.apply(Submit(self.new_id(), prompt, 1))
        self.apply(Step(1024))

    @configured_rule(precondition=lambda self: self.enabled("transfers") and self.session is not None
                     and not self.session.active(),
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     length=lambda c: st.integers(c.max_len // 2, c.max_len - 1), k=lambda c: st.integers(1, 2),
                     offset=lambda c: st.integers(1, max(1, c.B - 1)), more=lambda c: st.integers(0, 1),
                     fate=lambda c: st.sampled_from(("ok", "evict", "ok", "fail", "ok", "short")))
    def local_tail_against_remote(self, seed, length, k, offset, more, fate):
        """The tiers' fourth case: a local hit ending inside block ``k``
        against the host tier's hit at that block's end.  A prompt is cached,
        then a prefix of it ending inside the block; distinct junk displaces
        the older entries (the state at the boundary goes to the host tier)
        but not the younger, mid-block one: it takes as many state slots as
        the pool has beyond the prompt's checkpoints (one per block, the
        densest a cache keeps), so an LRU keeps the entry cached last.  Then
        the prompt up to the boundary and one diverging token is asked for,
        and its load decided (``fate``) before it runs.  The tokens come from
        ``seed`` (a few draws instead of two prompts' worth)."""
        seqs = tail_against_remote(self, seed, length, k, offset, more)
        for i, seq in enumerate(seqs):
            if i == 3:  # a cache that keeps prompt ends only needs these (none where it kept them)
                displace_boundary_state(self, seqs[0], k * self.B, seqs[2])
            if self.fits(len(seq), 1):
                self.apply(Submit(self.new_id(), seq, 1))
                if i == 3:
                    self.apply(Step(1))  # the tiers are compared, the loads issued
                    if self.session.pending_loads():
                        fate = self._fate(fate)
                        self.apply(StoreEvict(0) if fate == "evict" else Deliver(0, fate, 0))
                self.apply(Drain(1024))
            if i == 0:
                boundary_state_alone(self, seq, k * self.B)
