"""What happened in a session, complete and in order: the record.

Each entry is a frozen event: an operation applied (:class:`OpApplied`), a
plan (:class:`Planned`), the no-cache oracle's verdict on a computed step
(:class:`Judged`), a transfer completion (:class:`TransferCompleted`), a
fault firing (:class:`FaultFired`), requests finished (:class:`Finished`),
drafts proposed and verified (:class:`DraftsProposed`, :class:`Verified`:
speculative decoding).
A disaggregated session (two workers) records the same events, and three of
its own: its plan over both workers (:class:`DisaggPlanned`), a transfer
between them submitted (:class:`TransferSubmitted`), and a transfer's
notice delivered to the implementation (:class:`NoticeReceived`); its
verdicts name the worker (``Judged.worker``) and its faults the transport.
Checkers read the record typed (``history.events``, :meth:`History.since`,
:meth:`History.issued`); repro files, reports and failure explanations read
its JSON form (:meth:`Event.to_dict`, :meth:`History.tail`,
:meth:`History.as_data`), unchanged since the record was a list of dicts.
Nothing is dropped (a failure's explanation takes the tail).

The checkers are shown more than the record keeps (the views, the logits:
:mod:`conformance.harness.checker`'s moments); the record keeps what a
replay and a reader need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from conformance.contract import RequestStep, StepPlan, Transfer, TransferDone
from conformance.disagg.contract import DisaggPlan, DisaggTransfer, TransferNotice
from conformance.harness.ops import DisaggOp, Op, op_to_dict

if TYPE_CHECKING:
    from conformance.harness.oracle import Verdict


@dataclass(frozen=True)
class OpApplied:
    """Operation number ``index`` of the session began."""

    kind: ClassVar[str] = "op"
    index: int
    op: Op | DisaggOp

    def to_dict(self) -> dict:
        return {"event": self.kind, "index": self.index, **op_to_dict(self.op)}


@dataclass(frozen=True)
class Planned:
    """``schedule()`` returned ``plan``.  Its JSON form is taken when the
    event is made: an implementation may reuse the lists it returned."""

    kind: ClassVar[str] = "plan"
    plan: StepPlan
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.plan
        object.__setattr__(self, "data", {"event": self.kind, "requests": [
            {"request_id": r.request_id, "start": r.start, "end": r.end, "block_table": list(r.block_table),
             "state_slot": r.state_slot, "state_init": r.state_init.kind, "state_source": r.state_init.source,
             "snapshots": [list(s) for s in r.snapshots],
             # speculative decoding, only on a step that verifies drafts
             **({"drafts": list(r.drafts), "draft_slots": list(r.draft_slots)} if r.drafts else {}),
             # sliding windows, only on a step that gives window tables
             **({"window_tables": [list(t) for t in r.window_tables]} if r.window_tables else {})}
            for r in p.requests],
            "kv_copies": [list(c) for c in p.kv_copies], "state_copies": [list(c) for c in p.state_copies],
            # host-tier traffic, only when there is some (most plans have none)
            **({"transfers": [transfer_to_dict(t) for t in p.transfers]} if p.transfers else {})})

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(self.plan.transfers)

    def to_dict(self) -> dict:
        return self.data


@dataclass(frozen=True)
class Judged:
    """The no-cache oracle's verdict on one request's computed step."""

    kind: ClassVar[str] = "verdict"
    request_id: str
    start: int
    end: int
    ok: bool
    max_rel_error: float
    reads: str  # provenance of what the step read
    first_bad_position: int | None = None
    worker: str = ""  # the worker that computed it (a disaggregated session's); "" for one worker

    def to_dict(self) -> dict:
        return {"event": self.kind, "request_id": self.request_id, "start": self.start, "end": self.end,
                "ok": self.ok, "max_rel_error": self.max_rel_error, "reads": self.reads,
                **({"worker": self.worker} if self.worker else {})}


@dataclass(frozen=True)
class TransferCompleted:
    kind: ClassVar[str] = "transfer-done"
    done: TransferDone
    # Loads: whether the bytes that landed are the source bytes of the entry
    # (the harness knows; the implementation verifies).  None: an offload, or
    # a load that failed.
    intact: bool | None = None

    @property
    def id(self) -> int:
        return self.done.id

    @property
    def ok(self) -> bool:
        return self.done.ok

    def to_dict(self) -> dict:
        d = self.done
        return {"event": self.kind, "id": d.id, "ok": d.ok, **({"error": d.error} if d.error else {}),
                **({"intact": self.intact} if self.intact is not None else {})}


@dataclass(frozen=True)
class FaultFired:
    """A fault (or the generator's transfer control, ``fault == "control"``)
    acted on ``transfer``; ``what`` says how.  In a disaggregated session the
    transfer is one between the workers and ``transport`` names the transport
    that ran (a fault of the metadata exchange names no transfer)."""

    kind: ClassVar[str] = "fault"
    fault: str
    what: str
    transfer: Transfer | DisaggTransfer | None = None
    transport: str = ""

    def to_dict(self) -> dict:
        return {"event": self.kind, "fault": self.fault, "what": self.what,
                **({"transfer": transfer_to_dict(self.transfer)} if self.transfer is not None else {}),
                **({"transport": self.transport} if self.transport else {})}


@dataclass(frozen=True)
class Finished:
    kind: ClassVar[str] = "finished"
    request_ids: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"event": self.kind, "requests": list(self.request_ids)}


@dataclass(frozen=True)
class DraftsProposed:
    """The harness (the drafter) proposed ``tokens`` for the request's next
    step (none: it withdrew its proposal)."""

    kind: ClassVar[str] = "drafts"
    request_id: str
    tokens: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"event": self.kind, "request_id": self.request_id, "tokens": list(self.tokens)}


@dataclass(frozen=True)
class Verified:
    """A step verified ``drafts`` after the sequence ``base`` (its length is
    the step's end); the oracle accepted the first ``accepted`` of them."""

    kind: ClassVar[str] = "verified"
    request_id: str
    base: tuple[int, ...] = field(repr=False)
    drafts: tuple[int, ...]
    accepted: int
    draft_slots: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return len(self.base)

    def rejected_prefix(self) -> tuple[int, ...] | None:
        """The shortest prefix that runs through a rejected draft (None: all accepted)."""
        if self.accepted == len(self.drafts):
            return None
        return self.base + self.drafts[: self.accepted + 1]

    def to_dict(self) -> dict:
        return {"event": self.kind, "request_id": self.request_id, "end": self.end, "drafts": list(self.drafts),
                "accepted": self.accepted}


# -- the disaggregated session's own ----------------------------------------------------
@dataclass(frozen=True)
class DisaggPlanned:
    """``schedule()`` returned ``plan``, over both workers.  Its JSON form is
    a plan's (``"plan"``: the single-worker readers show its requests), each
    request naming its worker, with the transfers submitted and the regions
    zeroed."""

    kind: ClassVar[str] = "plan"
    plan: DisaggPlan
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.plan
        object.__setattr__(self, "data", {"event": self.kind, "requests": [
            {"request_id": r.request_id, "worker": r.worker, "start": r.start, "end": r.end,
             "block_table": list(r.block_table), "state_slot": r.state_slot, "state_init": r.state_init.kind,
             "state_source": r.state_init.source, "snapshots": [list(s) for s in r.snapshots]}
            for r in p.requests],
            **({"transfers": [transfer_to_dict(t) for t in p.transfers]} if p.transfers else {}),
            **({"zero": [[z.worker, z.offset, z.length] for z in p.zero]} if p.zero else {})})

    def to_dict(self) -> dict:
        return self.data


@dataclass(frozen=True)
class TransferSubmitted:
    """A transfer between the workers was handed to the transport (its
    contract checked: a known request, disjoint destination ranges)."""

    kind: ClassVar[str] = "transfer-submitted"
    transfer: DisaggTransfer

    def to_dict(self) -> dict:
        return {"event": self.kind, **transfer_to_dict(self.transfer)}


@dataclass(frozen=True)
class NoticeReceived:
    """A transfer's notice, delivered to the implementation in this step's result."""

    kind: ClassVar[str] = "notice"
    notice: TransferNotice

    @property
    def verified(self) -> bool:
        """The transport completed every chunk and every chunk's digests agree."""
        n = self.notice
        return n.ok and all(c.ok and c.src_digest == c.dst_digest for c in n.chunks)

    def to_dict(self) -> dict:
        n = self.notice
        return {"event": self.kind, "id": n.id, "ok": n.ok, "chunks": len(n.chunks),
                "digests_agree": all(c.src_digest == c.dst_digest for c in n.chunks if c.ok),
                **({"error": n.error} if n.error else {})}


Event = (OpApplied | Planned | Judged | TransferCompleted | FaultFired | Finished | DraftsProposed | Verified
         | DisaggPlanned | TransferSubmitted | NoticeReceived)


@dataclass
class History:
    ops: list[Op | DisaggOp] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    # -- recording (the session and the transport) ---------------------------------------
    def begin(self, op: Op | DisaggOp) -> None:
        self.ops.append(op)
        self.events.append(OpApplied(len(self.ops) - 1, op))

    def plan(self, plan: StepPlan) -> None:
        self.events.append(Planned(plan))

    def judged(self, rs: RequestStep, verdict: Verdict, reads: str, worker: str = "") -> None:
        self.events.append(Judged(rs.request_id, rs.start, rs.end, verdict.ok, verdict.max_rel_error, reads,
                                  verdict.first_bad_position, worker))

    def completed(self, done: TransferDone, intact: bool | None = None) -> None:
        self.events.append(TransferCompleted(done, intact))

    def fault(self, name: str, transfer: Transfer | DisaggTransfer | None, what: str, transport: str = "") -> None:
        self.events.append(FaultFired(name, what, transfer, transport))

    def drafts(self, request_id: str, tokens: tuple[int, ...]) -> None:
        self.events.append(DraftsProposed(request_id, tuple(tokens)))

    def verified(self, verification: Verified) -> None:
        self.events.append(verification)

    def finished(self, request_ids: list[str]) -> None:
        if request_ids:
            self.events.append(Finished(tuple(request_ids)))

    def record(self, event: Event) -> None:
        """An event made elsewhere: a disaggregated session's own (it shows the
        same objects to its checkers), its transport's fault firings."""
        self.events.append(event)

    # -- reading (typed) ---------------------------------------------------------------
    def since(self, index: int) -> Sequence[Event]:
        """The events from position ``index`` on (a checker that folds
        incrementally keeps where it stopped: ``len(history.events)``)."""
        return self.events[index:]

    def issued(self, transfer_id: int) -> Transfer | None:
        """The transfer with this id, as the latest plan that carried it issued it."""
        for ev in reversed(self.events):
            if isinstance(ev, Planned):
                for t in ev.transfers:
                    if t.id == transfer_id:
                        return t
        return None

    def verified_this_step(self) -> dict[str, Verified]:
        """The verifications of the latest planned step, by request."""
        out: dict[str, Verified] = {}
        for ev in reversed(self.events):
            if isinstance(ev, Planned):
                break
            if isinstance(ev, Verified):
                out[ev.request_id] = ev
        return out

    # -- the JSON form -------------------------------------------------------------------
    def tail(self, n: int = 12) -> list[dict]:
        """The last ``n`` events as data: what a failure explanation shows."""
        return [ev.to_dict() for ev in self.events[-n:]]

    def as_data(self) -> list[dict]:
        return [ev.to_dict() for ev in self.events]


def transfer_to_dict(t: Transfer | DisaggTransfer) -> dict:
    if isinstance(t, DisaggTransfer):
        return {"id": t.id, "request_id": t.request_id, "op": t.op, "chunks": len(t.chunks), "bytes": t.nbytes}
    return {"id": t.id, "direction": t.direction, "kind": t.kind, "key": t.key, "device": t.device,
            "request_id": t.request_id, **({"window_group": t.window_group} if t.window_group is not None else {})}
