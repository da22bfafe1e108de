"""Coverage: counters of the situations a run reached.  A check requires some
of them to end above zero (a check whose situation never occurred proves
nothing).  Counted from what the session records, never from what the
implementation says about itself, except evictions, which are what its view
stopped listing (memory proved the view honest).  The pool probe's requests
(``session.probing``) are not counted: they are the harness's, not the check's.

Counters whose names promise an order or a cause count exactly that:

- ``hits_after_eviction``: a prefix hit (a new request's first step starts
  past 0) in a session whose cache had already evicted an entry before that
  step -- reuse that survived pressure, not a hit and an eviction anywhere;
- ``tier_hits``: a prefix hit whose step read bytes a tier load landed (a
  KV block or the state slot of the hit, by the load's id in memory, copies
  included) -- a hit served by the second tier, not any load and any hit;
- ``tier_recoveries``: the first step of a request a load of which came back
  failed or with bytes other than its entry's (the transport says which):
  the request went on after the tier failed it (the logits judged how).
  What environment faults leave of ``tier_hits`` where they break most loads.
"""

from __future__ import annotations

from conformance.harness.checker import Checker

# Counters every run reports; checkers of other concerns add their own.
COUNTERS = ("steps", "requests", "prefix_hits", "mid_block_hits", "snapshot_reuse", "multi_turn_hits",
            "chunked_prefills", "mid_block_chunk_ends", "evictions", "decode_steps", "aborts",
            "tier_offloads", "tier_loads",  # transfers to and from the host tier that completed ok
            "hits_after_eviction", "tier_hits")


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
        if not session.probing:  # the pool probe's requests are not the situations a check asks for
            self._count(session, "requests")

    def aborted(self, session, request_id):
        self._count(session, "aborts")

    def scheduled(self, session, plan, view):
        if session.probing:
            return
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
                self._count(session, "hits_after_eviction", session.coverage.get("evictions", 0) > 0)
            if rs.state_init.kind == "copy" and rs.start > 0 and first:
                self._count(session, "snapshot_reuse")
            if rs.end < track.prompt_len:
                self._count(session, "chunked_prefills", first)
                self._count(session, "mid_block_chunk_ends", rs.end % B != 0)
            if rs.start >= track.prompt_len:
                self._count(session, "decode_steps")

    def computed(self, session, executed):
        rs = executed.step
        if not session.probing and session.tracks[rs.request_id].computed is None:
            if rs.start > 0:
                self._count(session, "tier_hits", bool(executed.loads_read))
            if rs.request_id in session.runner.transport.broken_for:  # (only there: most runs move nothing)
                self._count(session, "tier_recoveries")

    def settled(self, session, view, idle):
        done = session.runner.transport.succeeded
        session.coverage["tier_offloads"], session.coverage["tier_loads"] = done["offload"], done["load"]
        cached = ({("kv", e.block, e.tokens) for e in view.cached_kv}
                  | {("s", e.slot, e.tokens) for e in view.cached_states})
        if not session.probing:  # the probe evicts whatever it needs: not the check's pressure
            self._count(session, "evictions", len(self._cached_before - cached))
        self._cached_before = cached
