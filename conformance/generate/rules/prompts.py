"""New prompts: cut from shared bases, shared with earlier requests, continuing a finished one."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.draws import suffix_args
from conformance.harness.ops import Submit


class Prompts(MachineBase):
    """New prompts: cut from the shared bases at block-relative lengths, shared
    with any earlier request, or continuing a finished one (multi-turn)."""

    def _submit(self, prompt, max_new, continues=None):
        if self.fits(len(prompt), max_new):
            self.apply(Submit(self.new_id(), prompt, max_new, continues=continues))

    @configured_rule(base=lambda c: st.integers(0, 2),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     **suffix_args(lambda B: [0, 0, 1, B - 1, B + 1]))
    def submit(self, base, cut, suffix_len, suffix, max_new):
        self._submit(self.bases[base][:cut] + suffix[:suffix_len], max_new)

    @configured_rule(precondition=lambda self: self.enabled("continue") and self.finished,
                     which=lambda c: st.integers(0, 7), **suffix_args(lambda B: [1, 2, B - 1, B, B + 1]))
    def continue_turn(self, which, suffix_len, suffix, max_new):
        prev = self.finished[which % len(self.finished)]
        self._submit(self.session.tracks[prev].tokens + suffix[:suffix_len], max_new, continues=prev)

    @configured_rule(precondition=lambda self: self.session is not None and self.session.tracks,
                     which=lambda c: st.integers(0, 7),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     **suffix_args(lambda B: [1, 2, B - 1, B + 1]))
    def share(self, which, cut, suffix_len, suffix, max_new):
        """A prompt that shares a boundary-relative prefix with any earlier
        request (finished, running or aborted): where snapshots get reused."""
        rids = list(self.session.tracks)
        self._submit(self.session.tracks[rids[which % len(rids)]].tokens[:cut] + suffix[:suffix_len], max_new)
