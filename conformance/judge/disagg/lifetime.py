"""Nothing held at rest: once a drain finished every request and no transfer
is in flight, the implementation holds no decode page and runs no request
(only cache entries on the prefill side may stay), as its view states them.
An implementation without a view is not judged here (noted)."""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.disagg.checker import DisaggChecker


class NothingHeldAtRest(DisaggChecker):
    name = "disagg-at-rest"

    def settled(self, obs, ev):
        view = ev.view
        if not isinstance(view, dict):
            self.notes.add("the disaggregated implementation states no view (view() -> dict): "
                           "nothing held at rest was not checked")
            return
        if view.get("decode_used"):
            raise ConformanceFailure("invariant", f"[{obs.transport}] decode pages still held after every "
                                                  f"request finished: {view['decode_used']}")
        if view.get("running"):
            raise ConformanceFailure("invariant", f"[{obs.transport}] requests still running after finishing: "
                                                  f"{view['running']}")
