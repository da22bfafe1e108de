"""The no-cache oracle as a checker: every computed logit equals the logit of
a from-scratch run of the same tokens (exact to 1e-9 relative in float64)."""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker


class LogitsMatchReference(Checker):
    name = "logits"

    def computed(self, session, executed):
        if executed.logits is None:  # a dry step of the pool probe: capacity, not logits
            return
        rs = executed.step
        track = session.tracks[rs.request_id]
        # a verification step's logits continue through its drafts
        verdict = session.oracle.judge(track.tokens + tuple(rs.drafts), rs.start, executed.logits)
        session.history.judged(rs, verdict, executed.reads)
        if not verdict.ok:
            raise ConformanceFailure(
                "logits", f"request {rs.request_id} positions [{rs.start}, {rs.end}): logits differ from the "
                          f"no-cache reference by {verdict.max_rel_error:.3g} (relative) from position "
                          f"{verdict.first_bad_position}; reads: {executed.reads}")
