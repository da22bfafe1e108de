"""The no-cache oracle as a checker: every computed logit equals the logit of
a from-scratch run of the same tokens (exact to 1e-9 relative in float64).
The session measures the oracle's verdict on each computed step (it is in the
record, :class:`~conformance.harness.history.Judged`); this checker fails the
step it is wrong for."""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker


class LogitsMatchReference(Checker):
    name = "logits"

    def computed(self, obs, executed):
        verdict = executed.verdict
        if verdict is None:  # a dry step of the pool probe: capacity, not logits
            return
        rs = executed.step
        if not verdict.ok:
            raise ConformanceFailure(
                "logits", f"request {rs.request_id} positions [{rs.start}, {rs.end}): logits differ from the "
                          f"no-cache reference by {verdict.max_rel_error:.3g} (relative) from position "
                          f"{verdict.first_bad_position}; reads: {executed.reads}")
