"""Engine steps: one under a token budget, or draining everything."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Drain, Step


class Steps(MachineBase):
    """Engine steps: one at a time under a token budget (chunked prefill,
    decode interleaved), or draining everything."""

    @configured_rule(precondition=lambda self: self.enabled("step") and self.busy(),
                     budget=lambda c: strategies.budgets(c.B))
    def step(self, budget):
        self.apply(Step(budget))

    @configured_rule(precondition=lambda self: self.busy(),
                     budget=lambda c: strategies.budgets(c.B) if "step" in c.spec.rules else st.just(1024))
    def drain(self, budget):
        self.apply(Drain(budget))
