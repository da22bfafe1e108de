"""The no-cache oracle as a checker of a disaggregated session: every logit
computed on either worker equals the logit of a from-scratch run of the same
tokens (the session measures the verdict, recorded as ``Judged``; a prefill
worker keeping a float32 state is judged at float32's tolerance).  The
failure says what the audit found in the bytes the step read."""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.disagg.checker import DisaggChecker


class DisaggLogitsMatchReference(DisaggChecker):
    name = "disagg-logits"

    def computed(self, obs, ev):
        v, rs = ev.verdict, ev.step
        if not v.ok:
            raise ConformanceFailure(
                "logits", f"[{obs.transport}] {rs.request_id} on {ev.worker} [{rs.start}, {rs.end}): logits differ "
                          f"from the no-cache reference at position {v.first_bad_position} "
                          f"(max rel err {v.max_rel_error:.3g}); reads: {ev.reads}")
