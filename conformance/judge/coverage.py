"""Coverage: counters of the situations a run reached.  A check requires some
of them to end above zero (a check whose situation never occurred proves
nothing).  Counted from what the session records, never from what the
implementation says about itself, except evictions, which are what its view
stopped listing (memory proved the view honest; the session measures them,
``Observation.evicted``).  The pool probe's requests (``obs.probing``) are
not counted: they are the harness's, not the check's.

Counters whose names promise an order or a cause count exactly that:

- ``hits_after_eviction``: a prefix hit (a new request's first step starts
  past 0) in a session whose cache had already evicted an entry before that
  step -- reuse that survived pressure, not a hit and an eviction anywhere;
- ``tier_hits``: a prefix hit whose step read bytes a tier load landed (a
  KV block or the state slot of the hit, by the load's id in memory, copies
  included) -- a hit served by the second tier, not any load and any hit;
- ``tier_recoveries``: the first step of a request a load of which came back
  failed or with bytes other than its entry's (the record's
  ``TransferCompleted.intact``, which the transport sets):
  the request went on after the tier failed it (the logits judged how).
  What environment faults leave of ``tier_hits`` where they break most loads.
"""

from __future__ import annotations

from conformance.harness.checker import Checker
from conformance.harness.history import TransferCompleted

# Counters every run reports; checkers of other concerns add their own.
COUNTERS = ("steps", "requests", "prefix_hits", "mid_block_hits", "snapshot_reuse", "multi_turn_hits",
            "chunked_prefills", "mid_block_chunk_ends", "evictions", "decode_steps", "aborts",
            "tier_offloads", "tier_loads",  # transfers to and from the host tier that completed ok
            "hits_after_eviction", "tier_hits")


class CoverageCounter(Checker):
    name = "coverage"

    def __init__(self):
        super().__init__()
        self._seen = 0  # events of the record read for broken loads
        self._broken: set = set()

    def attached(self, obs):
        for key in COUNTERS:
            self.coverage.setdefault(key, 0)

    def submitted(self, obs, ev):
        if not obs.probing:  # the pool probe's requests are not the situations a check asks for
            self.count("requests")

    def aborted(self, obs, ev):
        self.count("aborts")

    def scheduled(self, obs, ev):
        if obs.probing:
            return
        self.coverage["steps"] = obs.step_no
        B = obs.layout.block_size
        for rs in ev.plan.requests:
            track = obs.tracks[rs.request_id]
            first = track.computed is None
            if first and rs.start > 0:
                self.count("prefix_hits")
                self.count("mid_block_hits", rs.start % B != 0)
                if track.continues is not None:
                    self.count("multi_turn_hits")
                self.count("hits_after_eviction", obs.evicted > 0)
            if rs.state_init.kind == "copy" and rs.start > 0 and first:
                self.count("snapshot_reuse")
            if rs.end < track.prompt_len:
                self.count("chunked_prefills", first)
                self.count("mid_block_chunk_ends", rs.end % B != 0)
            if rs.start >= track.prompt_len:
                self.count("decode_steps")

    def computed(self, obs, executed):
        rs = executed.step
        if not obs.probing and obs.tracks[rs.request_id].computed is None:
            if rs.start > 0:
                self.count("tier_hits", bool(executed.loads_read))
            if rs.request_id in self._broken_loads(obs):  # (counted only there: most runs move nothing)
                self.count("tier_recoveries")

    def _broken_loads(self, obs) -> set:
        """Requests a load of which completed failed or not intact (from the record)."""
        for ev in obs.history.since(self._seen):
            if isinstance(ev, TransferCompleted) and (not ev.ok or ev.intact is False):
                t = obs.history.issued(ev.id)
                if t is not None and t.direction == "load":
                    self._broken.add(t.request_id)
        self._seen = len(obs.history.events)
        return self._broken

    def settled(self, obs, ev):
        done = obs.transfers_succeeded
        self.coverage["tier_offloads"], self.coverage["tier_loads"] = done["offload"], done["load"]
        # the session's measure (entries its views stopped listing, outside the probe)
        self.coverage["evictions"] = obs.evicted
