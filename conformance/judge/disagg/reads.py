"""The audit of what decode read: every byte a decode step's tile kernel
read -- the KV of the positions before it, the state it resumes, the rest of
its last block -- was written for the request's tokens (by whichever request
computed that prefix: prefix hits are legitimate) or is a zeroed tail.
Memory's provenance answers (the session reports what it found, measured
before the step wrote: ``WorkerComputed.stale``); what the implementation
says is never consulted.  A stale byte that left the logits right (a finite
stale tail has weight 0) still fails: the next tenant's bytes may be NaN."""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.disagg.checker import DisaggChecker


class DecodeReadsAudited(DisaggChecker):
    name = "disagg-reads"

    def computed(self, obs, ev):
        if ev.stale:
            rs = ev.step
            raise ConformanceFailure("invariant", f"[{obs.transport}] {rs.request_id} on {ev.worker} "
                                                  f"[{rs.start}, {rs.end}): {ev.stale[0]}")
