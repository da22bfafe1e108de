"""The client goes away: an active request aborted."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Abort


class Aborts(MachineBase):
    """The client goes away."""

    @configured_rule(precondition=lambda self: self.enabled("abort") and self.busy(),
                     which=lambda c: st.integers(0, 7))
    def abort(self, which):
        active = self.session.active()
        self.apply(Abort(active[which % len(active)]))
