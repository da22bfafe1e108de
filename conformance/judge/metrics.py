"""Cache metrics the harness measures from what it observes (plans, views),
for any implementation: the two a conventional engine does not have
(design note, "How to run it in production").

Per new request, at its first scheduled step (prompt tokens only):

- ``kv_hit_rate``: prompt tokens whose KV the cache held when the request was
  matched (the longest covered prefix, one token left to compute; the least
  over the schedules between submission and first step, see
  ``reuse.LookupWindow``), over all prompt tokens.  What a conventional
  prefix-cache hit rate reports.
- ``state_hit_rate``: prompt tokens actually reused (the step's start, which
  needs a recurrent state at that position), over all prompt tokens.
- ``recomputed_no_state``: tokens the KV could serve but that were computed
  again because no state existed at that boundary -- the failure signature of
  a bad retention policy (a healthy KV hit rate, a collapsed state hit rate).

Per step, after it ran: occupancy of recurrent-state slots and of KV blocks,
separately (a slot or block is occupied when a request holds it or it is
cached for reuse).
"""

from __future__ import annotations

from conformance.harness.checker import Checker
from conformance.judge.reuse import LookupWindow

COUNTS = ("requests", "prompt_tokens", "kv_hit_tokens", "state_hit_tokens", "recomputed_no_state",
          "kv_hit_requests", "state_hit_requests", "steps")


class CacheMetrics(Checker):
    """Measures, never fails: one object follows every session of a check
    (add it to each); ``summary()`` is plain data for results.json."""

    name = "metrics"

    def __init__(self, keep_series: bool = False):
        super().__init__()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.occ_sum = {"kv": 0.0, "state": 0.0}
        self.occ_peak = {"kv": 0.0, "state": 0.0}
        self.admitted: set[tuple[int, ...]] = set()  # distinct state prefixes ever seen cached
        self.first_start: dict[str, int] = {}  # request -> tokens reused at its first step
        self.keep_series = keep_series
        self.series: list[dict] = []  # per step, for plots
        self.window = LookupWindow()

    def stepped(self, obs, record) -> None:
        if obs.probing:  # the pool probe's cold requests are not the workload's
            return
        plan, view_before = record.plan, record.view_before
        c = self.counts
        c["steps"] += 1
        floors = self.window.observe(obs, plan, view_before)
        for rs in plan.requests:
            if rs.request_id not in floors:
                continue
            track = obs.tracks[rs.request_id]
            kv = max(floors[rs.request_id][0], rs.start)  # a view may not list its KV; the start proves it
            c["requests"] += 1
            c["prompt_tokens"] += track.prompt_len
            c["kv_hit_tokens"] += kv
            c["state_hit_tokens"] += rs.start
            c["recomputed_no_state"] += kv - rs.start
            c["kv_hit_requests"] += kv > 0
            c["state_hit_requests"] += rs.start > 0
            self.first_start[rs.request_id] = rs.start
        view = obs.last_view
        lay = obs.layout
        slots = {s for s, n in view.state_refcounts.items() if n > 0} | {e.slot for e in view.cached_states}
        blocks = {b for b, n in view.kv_refcounts.items() if n > 0} | {e.block for e in view.cached_kv}
        occ = {"kv": len(blocks) / lay.num_kv_blocks, "state": len(slots) / lay.num_state_slots}
        for k, v in occ.items():
            self.occ_sum[k] += v
            self.occ_peak[k] = max(self.occ_peak[k], v)
        self.admitted.update(e.tokens for e in view.cached_states)
        if self.keep_series:
            self.series.append({"step": c["steps"], "requests": c["requests"],
                                "kv_hit_rate": _rate(c["kv_hit_tokens"], c["prompt_tokens"]),
                                "state_hit_rate": _rate(c["state_hit_tokens"], c["prompt_tokens"]),
                                "kv_occupancy": occ["kv"], "state_occupancy": occ["state"],
                                "kv_blocks": len(blocks), "state_slots": len(slots)})

    def summary(self) -> dict:
        c = self.counts
        return _finish({**{k: c[k] for k in COUNTS}, "states_admitted": len(self.admitted),
                        "kv_occupancy_sum": self.occ_sum["kv"], "state_occupancy_sum": self.occ_sum["state"],
                        "kv_occupancy_peak": round(self.occ_peak["kv"], 4),
                        "state_occupancy_peak": round(self.occ_peak["state"], 4)})


def merge_summaries(summaries: list[dict]) -> dict:
    """One implementation's metrics over several checks (summaries carry their
    raw counts, so rates are recomputed, not averaged)."""
    total: dict = {k: 0 for k in (*COUNTS, "states_admitted", "kv_occupancy_sum", "state_occupancy_sum")}
    total.update(kv_occupancy_peak=0.0, state_occupancy_peak=0.0)
    for s in summaries:
        for k in total:
            if k.endswith("_peak"):
                total[k] = max(total[k], s.get(k, 0.0))
            else:
                total[k] += s.get(k, 0)
    return _finish(total)


def _finish(d: dict) -> dict:
    steps = max(d["steps"], 1)
    return {
        "kv_hit_rate": _rate(d["kv_hit_tokens"], d["prompt_tokens"]),
        "state_hit_rate": _rate(d["state_hit_tokens"], d["prompt_tokens"]),
        "recomputed_no_state_tokens": d["recomputed_no_state"],
        "kv_occupancy_mean": round(d["kv_occupancy_sum"] / steps, 4),
        "kv_occupancy_peak": d["kv_occupancy_peak"],
        "state_occupancy_mean": round(d["state_occupancy_sum"] / steps, 4),
        "state_occupancy_peak": d["state_occupancy_peak"],
        **{k: d[k] for k in (*COUNTS, "states_admitted", "kv_occupancy_sum", "state_occupancy_sum")},
    }


def _rate(num: int, den: int) -> float:
    return round(num / den, 4) if den else 0.0
