"""Coverage: counters of the situations a run reached.  A check requires some
of them to end above zero (a check whose situation never occurred proves
nothing).  Counted from what the session records, never from what the
implementation says about itself, except evictions, which are what its view
stopped listing (memory proved the view honest)."""

from __future__ import annotations

from conformance.harness.checker import Checker

# Counters every run reports; checkers of other concerns add their own.
COUNTERS = ("steps", "requests", "prefix_hits", "mid_block_hits", "snapshot_reuse", "multi_turn_hits",
            "chunked_prefills", "mid_block_chunk_ends", "evictions", "decode_steps", "aborts",
            "tier_offloads", "tier_loads")  # transfers to and from the host tier that completed ok


class CoverageCounter(Checker):
    name = "coverage"

    def __init__(self):
        self._cached_before: set = set()

    def attached(self, session):
        for key in COUNTERS:
            session.coverage.setdefault(key, 0)

    def _count(self, session, key: str, n: int = 1) -> None:
        session.coverage[key] = session.coverage.get(key, 0) + n

    def submitted(self, session, request):
        self._count(session, "requests")

    def aborted(self, session, request_id):
        self._count(session, "aborts")

    def scheduled(self, session, plan, view):
        session.coverage["steps"] = session.step_no
        B = session.layout.block_size
        for rs in plan.requests:
            track = session.tracks[rs.request_id]
            first = track.computed is None
            if first and rs.start > 0:
                self._count(session, "prefix_hits")
                self._count(session, "mid_block_hits", rs.start % B != 0)
                if track.continues is not None:
                    self._count(session, "multi_turn_hits")
            if rs.state_init.kind == "copy" and rs.start > 0 and first:
                self._count(session, "snapshot_reuse")
            if rs.end < track.prompt_len:
                self._count(session, "chunked_prefills", first)
                self._count(session, "mid_block_chunk_ends", rs.end % B != 0)
            if rs.start >= track.prompt_len:
                self._count(session, "decode_steps")

    def settled(self, session, view, idle):
        done = session.runner.transport.succeeded
        session.coverage["tier_offloads"], session.coverage["tier_loads"] = done["offload"], done["load"]
        cached = ({("kv", e.block, e.tokens) for e in view.cached_kv}
                  | {("s", e.slot, e.tokens) for e in view.cached_states})
        self._count(session, "evictions", len(self._cached_before - cached))
        self._cached_before = cached
