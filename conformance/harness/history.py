"""What happened in a session, complete and in order, as plain data:
operations applied, plans, verdicts, transfer completions, fault firings,
finished and aborted requests.  Repro files, reports and failure explanations
read it; nothing is dropped (a failure's explanation takes the tail)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.contract import RequestStep, StepPlan, Transfer, TransferDone
from conformance.harness.ops import Op, op_to_dict


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def begin(self, op: Op) -> None:
        self.ops.append(op)
        self.events.append({"event": "op", "index": len(self.ops) - 1, **op_to_dict(op)})

    def plan(self, plan: StepPlan) -> None:
        self.events.append({"event": "plan", "requests": [
            {"request_id": r.request_id, "start": r.start, "end": r.end, "block_table": list(r.block_table),
             "state_slot": r.state_slot, "state_init": r.state_init.kind, "state_source": r.state_init.source,
             "snapshots": [list(s) for s in r.snapshots]} for r in plan.requests],
            "kv_copies": [list(c) for c in plan.kv_copies], "state_copies": [list(c) for c in plan.state_copies],
            # host-tier traffic, only when there is some (most plans have none)
            **({"transfers": [_transfer(t) for t in plan.transfers]} if plan.transfers else {})})

    def judged(self, rs: RequestStep, verdict, reads: str) -> None:
        self.events.append({"event": "verdict", "request_id": rs.request_id, "start": rs.start, "end": rs.end,
                            "ok": verdict.ok, "max_rel_error": verdict.max_rel_error, "reads": reads})

    def completed(self, done: TransferDone, intact: bool | None = None) -> None:
        """``intact`` (loads): whether the bytes that landed are the source
        bytes of the entry (the harness knows; the implementation verifies)."""
        self.events.append({"event": "transfer-done", "id": done.id, "ok": done.ok,
                            **({"error": done.error} if done.error else {}),
                            **({"intact": intact} if intact is not None else {})})

    def fault(self, name: str, transfer: Transfer | None, what: str) -> None:
        self.events.append({"event": "fault", "fault": name, "what": what,
                            **({"transfer": _transfer(transfer)} if transfer is not None else {})})

    def finished(self, request_ids: list[str]) -> None:
        if request_ids:
            self.events.append({"event": "finished", "requests": list(request_ids)})

    def tail(self, n: int = 12) -> list[dict]:
        """The last ``n`` events: what a failure explanation shows."""
        return list(self.events[-n:])

    def ops_as_data(self) -> list[dict]:
        return [op_to_dict(op) for op in self.ops]


def _transfer(t: Transfer) -> dict:
    return {"id": t.id, "direction": t.direction, "kind": t.kind, "key": t.key, "device": t.device,
            "request_id": t.request_id}
