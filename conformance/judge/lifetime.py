"""The pool probe's verdict: at idle a cache serves what a fresh instance of
it serves; one that cannot has leaked a KV block or a state slot, whatever
its view says (an ``invariant`` failure whose message starts "lifetime:").

The session executes the probe (:mod:`conformance.harness.pool_probe`) and
shows this checker two moments: what the concurrent part's one step
scheduled, and a part that could not be served (its drain stalled).

- Concurrent: ``probe.concurrent`` short requests submitted together must be
  scheduled at least ``probe.expect`` at a time (a fresh instance's figure).
  Inconclusive when a probe request reuses a cached prefix or waits for a
  load: a correct cache may then pin more, or admit later.  A block or slot
  a transfer holds (of that step: an offload the cache queued at idle; or a
  load still in flight) is held, not leaked: each may keep one request out,
  and the message names them.
- Served: every part must finish.  Not only a leak starves the long request:
  a cache whose hit on a held prefix needs more of the pool than recomputing
  (a copy-on-write of a partial block) and that never recomputes instead
  waits forever at idle too; the message names the held prefix then.
"""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker, ProbeStall, ProbeStep
from conformance.harness.probe_prompts import SHORT_LEN

LEAKED = "KV blocks or state slots are held by nothing (leaked)"


class PoolProbeServed(Checker):
    name = "lifetime"

    def probed(self, obs, ev):
        if isinstance(ev, ProbeStep):
            self._scheduled_together(obs, ev)
        elif isinstance(ev, ProbeStall):
            self._not_served(obs, ev)

    @staticmethod
    def _scheduled_together(obs, ev: ProbeStep) -> None:
        plan, ids, expect = ev.plan, ev.ids, ev.probe.expect
        ran = [rs for rs in plan.requests if rs.request_id in ids]
        reused = any(rs.start > 0 for rs in ran) or any(t.direction == "load" for t in plan.transfers)
        moving = sorted({(t.kind, t.device, t.direction) for t in (*plan.transfers, *obs.pending_loads())})
        if len(ran) + len(moving) < expect and not reused:
            holders = ""
            if moving:
                what = ", ".join(f"{'KV block' if k == 'kv' else 'state slot'} {d} ({direction})"
                                 for k, d, direction in moving[:4]) + (" ..." if len(moving) > 4 else "")
                holders = (f"; transfers of that step or in flight held {len(moving)} ({what}), and "
                           f"{expect - len(ran) - len(moving)} more")
            raise ConformanceFailure("invariant", f"lifetime: at idle, {len(ran)} of {len(ids)} {SHORT_LEN}-token "
                                                  f"requests submitted together were scheduled in one step; a fresh "
                                                  f"instance schedules {expect}{holders}: {LEAKED}")

    @staticmethod
    def _not_served(obs, ev: ProbeStall) -> None:
        if ev.part == "concurrent":
            what, why = f"{ev.requests} {SHORT_LEN}-token requests", LEAKED
        else:
            lay, kv_tokens = obs.layout, ev.probe.kv_tokens
            need = -(-kv_tokens // lay.block_size)
            what = (f"a {kv_tokens}-token request ({need} of the {lay.num_kv_blocks} KV blocks), which a fresh "
                    f"instance serves,")
            why = LEAKED if not ev.held else (f"{LEAKED}, or a hit on its first {ev.held} tokens (a state slot holds "
                                              f"them) needs more of the pool than recomputing them and the cache "
                                              f"never recomputes instead")
        raise ConformanceFailure("invariant", f"lifetime: at idle, {what} could not be served ({ev.stall}): {why}")
