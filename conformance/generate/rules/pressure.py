"""Memory pressure between requests: distinct long prompts run to completion, then reuse."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.draws import junk_prompts
from conformance.harness.ops import Drain, Submit


class Pressure(MachineBase):
    """Memory pressure: distinct long prompts, run to completion, so cached
    entries must be evicted."""

    @configured_rule(precondition=lambda self: self.enabled("pressure") and self.session is not None
                     and not self.session.active(), junk=junk_prompts, which=lambda c: st.integers(0, 7),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     suffix=lambda c: strategies.tokens(c.vocab, 1))
    def pressure(self, junk, which, cut, suffix):
        before = list(self.session.tracks)
        # The latest junk one token short, so that it and one token more fit
        # the longest sequence (the reuse below extends it whole).
        junk = [prompt[: self.longest_alone()] for prompt in junk]  # (the pool bounds it where it is small)
        junk = [*junk[:-1], junk[-1][:-1]]
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        # Reuse right after the pool turned over.  First the latest junk whole
        # and one token more: what an LRU cache still holds, and at the depth
        # every cache that reuses keeps (a state at the prompt's end, or at its
        # last checkpoint before it; SGLang's no_buffer mode keeps the end
        # only, so a prefix cut inside the prompt never hits there), so that a
        # hit after an eviction -- what eviction-pressure requires -- occurs
        # whenever this round evicted.  Then a prefix of a request from before
        # (evicted: a miss, or a load from a second tier) and one of the latest
        # junk, cut at a block boundary or beside it.
        earlier = [self.session.tracks[before[which % len(before)]].tokens] if before else []
        reuse = [junk[-1] + suffix] + [seq[: min(cut, len(seq) - 1)] + suffix for seq in (*earlier, junk[-1])]
        for again in reuse:
            if self.fits(len(again), 1):
                self.apply(Submit(self.new_id(), again, 1))
                self.apply(Drain(1024))
