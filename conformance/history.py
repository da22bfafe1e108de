"""What happened, step by step, as data: operations applied, plans executed
and verdicts.  Repro files, reports and failure explanations read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .contract import RequestStep, StepPlan
from .ops import Op, op_to_dict


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    keep_events: int = 64  # a bounded tail: the failure explanation needs only the last steps

    def begin(self, op: Op) -> None:
        self.ops.append(op)
        self._add({"event": "op", "index": len(self.ops) - 1, **op_to_dict(op)})

    def plan(self, plan: StepPlan) -> None:
        self._add({"event": "plan", "requests": [
            {"request_id": r.request_id, "start": r.start, "end": r.end, "block_table": list(r.block_table),
             "state_slot": r.state_slot, "state_init": r.state_init.kind, "state_source": r.state_init.source,
             "snapshots": [list(s) for s in r.snapshots]} for r in plan.requests],
            "kv_copies": [list(c) for c in plan.kv_copies], "state_copies": [list(c) for c in plan.state_copies],
            # host-tier traffic, only when there is some (most plans have none)
            **({"transfers": [{"id": t.id, "direction": t.direction, "kind": t.kind, "key": t.key,
                               "device": t.device, "request_id": t.request_id} for t in plan.transfers]}
               if plan.transfers else {})})

    def judged(self, rs: RequestStep, verdict, reads: str) -> None:
        self._add({"event": "verdict", "request_id": rs.request_id, "start": rs.start, "end": rs.end,
                   "ok": verdict.ok, "max_rel_error": verdict.max_rel_error, "reads": reads})

    def _add(self, event: dict) -> None:
        self.events.append(event)
        if len(self.events) > self.keep_events:
            del self.events[: len(self.events) - self.keep_events]

    def ops_as_data(self) -> list[dict]:
        return [op_to_dict(op) for op in self.ops]
