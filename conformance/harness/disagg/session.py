"""A disaggregated session: one implementation, two workers, one transport,
one model and oracle, and the checkers that judge it.

It applies the disaggregated operations (:mod:`.ops`), every call into the
implementation guarded as the single-worker session's are
(:mod:`conformance.harness.guard`: a raise or a hang is a finding, ``raised``
or ``timeout``), and records everything in the one history
(:mod:`conformance.harness.history`): the operations, each plan
(:class:`~conformance.harness.history.DisaggPlanned`), each transfer
submitted, each verdict, each fault firing, each notice delivered, the
requests finished.

Each step: the implementation's :class:`~conformance.disagg.contract.DisaggPlan`
is executed in engine order -- tail zeroing, new transfers submitted, one
transport tick (posts a chunk of every transfer in flight, collects notices),
then every worker-tagged request step on its worker's memory, measured
(the oracle's verdict; on the decode side, every byte read that memory's
provenance does not give to the request) -- and each moment is shown to the
checkers (:mod:`.checker`) with a read-only observation of the session
(:class:`DisaggSessionObservation`).  Notices reach the implementation in the
same step's result.  The session itself enforces only the contract (ids,
ranges, workers, types) and liveness (a stall); every other judgement
(logits, the audit of what decode read, nothing held at rest, coverage) is a
checker's, of :mod:`conformance.judge.disagg`.  Every failure names the
transport that ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn

import torch

from conformance.contract import ImplConfig, Request, RequestStep
from conformance.disagg.contract import (
    DECODE,
    PREFILL,
    WORKERS,
    DisaggLayouts,
    DisaggPlan,
    DisaggResult,
    DisaggTransfer,
)
from conformance.errors import ConformanceFailure, ContractError
from conformance.harness.checker import Aborted, BaseChecker, CheckerSet, Submitted
from conformance.harness.guard import guarded
from conformance.harness.history import DisaggPlanned, FaultFired, History, NoticeReceived, TransferSubmitted
from conformance.harness.observation import Record, Track
from conformance.harness.ops import MAX_DRAIN_STEPS
from conformance.harness.oracle import TOLERANCE, Oracle
from conformance.model import TinyHybrid

from .checker import DISAGG_PHASE_OF, DisaggScheduled, DisaggSettled, DisaggStepRecord, WorkerComputed
from .faults import FaultSpec
from .ops import (
    DisaggAbort,
    DisaggArmFault,
    DisaggDrain,
    DisaggOp,
    DisaggStep,
    DisaggSubmit,
    prompt_for,
    prompt_shared,
)
from .worker_memory import WorkerMemory
from .worker_runner import run_step
from .workers import WorkerPool, Workers, build_workers, make_transport

# After a drain: idle steps (at most this many) while the implementation still holds decode pages.
IDLE_STEPS = 10
# The methods a disaggregated implementation has (``view()`` is optional: without it nothing is judged at rest).
METHODS = ("disagg_layouts", "connect", "add_request", "schedule", "update", "abort")
PROMPT_SEED = 0  # prompts are seeded by request id (ops.prompt_for); one seed for every scenario


@dataclass
class DisaggSession:
    impl: Any  # a disaggregated implementation (see conformance.disagg.contract)
    model: TinyHybrid
    oracle: Oracle
    checkers: CheckerSet
    transport: str = "auto"
    faults: tuple[FaultSpec, ...] = ()
    pool: WorkerPool | None = None  # workers built earlier, handed out reset (memory and transport)
    timeout: float | None = 30.0
    history: History = field(default_factory=History)

    def __post_init__(self) -> None:
        missing = [m for m in METHODS if not callable(getattr(self.impl, m, None))]
        if missing:
            raise TypeError(f"{type(self.impl).__name__} is not a disaggregated implementation: "
                            f"no {', '.join(m + '()' for m in missing)}")
        self.layouts: DisaggLayouts = self.call("disagg_layouts")
        if not isinstance(self.layouts, DisaggLayouts):
            raise ConformanceFailure("contract", f"disagg_layouts() returned {type(self.layouts).__name__}, "
                                                 f"not DisaggLayouts")
        if self.pool is None:
            tr, self.transport_why = make_transport(self.transport, self.faults)
            tr.history = self.history  # a fault of the metadata exchange is this session's
            self.workers: Workers = build_workers(self.layouts, self.model.config, tr)
        else:
            self.workers, self.transport_why = self.pool.get(self.layouts)
            self.workers.transport.history = self.history
        self.transport_name = self.workers.transport.name
        try:
            self.call("connect", self.workers.handshake)
        except BaseException:
            self.close()  # a session that never started leaves no peer process nor shared memory behind
            raise
        self.tracks: dict[str, Track] = {}
        self.step_no = 0  # schedule() calls so far
        self.in_flight: tuple[DisaggTransfer, ...] = ()  # as the latest transport tick began
        self._shared = prompt_shared(PROMPT_SEED, self.model.config.vocab_size)
        ptype = self.workers.prefill.geometry.layout.state_dtype
        # a float32 prefill state (the dtype-mismatch fault) rounds what prefill reads back
        self.prefill_oracle = self.oracle if ptype == "float64" else Oracle(self.model, TOLERANCE[torch.float32])
        self.observation = DisaggSessionObservation(self)
        self.checkers.phases = DISAGG_PHASE_OF  # the moments this session shows
        self.checkers.attach(self.observation)

    # -- what the session exposes ----------------------------------------------------------
    @property
    def coverage(self) -> dict[str, int]:
        """What the checkers counted (the check requires some counters to be > 0)."""
        return self.checkers.coverage()

    @property
    def notes(self) -> set[str]:
        return self.checkers.notes()

    @property
    def events(self) -> list[FaultFired]:
        """The fault firings of this session, from its history."""
        return [ev for ev in self.history.events if isinstance(ev, FaultFired)]

    @property
    def applied(self) -> int:
        """The index of the operation being (or last) applied: a failure names it."""
        return len(self.history.ops) - 1

    def active(self) -> list[str]:
        """Requests submitted and not finished or aborted, in submission order."""
        return [rid for rid, t in self.tracks.items() if not t.done]

    def in_flight_requests(self) -> list[str]:
        """Requests whose transfer is in flight now (submitted, not every chunk posted)."""
        return [f.transfer.request_id for f in self.workers.transport._flights]

    @property
    def transfers_submitted(self) -> int:
        """Transfers handed to the transport so far (what ``FaultSpec.transfer`` counts)."""
        return self.workers.transport._submitted

    def close(self) -> None:
        self.workers.transport.history = None
        if self.pool is None:
            self.workers.close()

    def call(self, method: str, *args: object) -> Any:
        """Call the implementation, guarded: a raise or a hang becomes an ImplementationError."""
        return guarded(f"{type(self.impl).__name__}.{method}()", getattr(self.impl, method), *args,
                       timeout=self.timeout)

    def fail(self, kind: str, message: str) -> NoReturn:
        raise ConformanceFailure(kind, f"[{self.transport_name}] {message}")

    # -- operations ------------------------------------------------------------------------
    def apply(self, op: DisaggOp) -> None:
        self.history.begin(op)
        if isinstance(op, DisaggSubmit):
            self._submit(op)
        elif isinstance(op, DisaggStep):
            for _ in range(op.count):
                self._step()
        elif isinstance(op, DisaggDrain):
            self._drain()
        elif isinstance(op, DisaggAbort):
            self._abort(op.request_id)
        elif isinstance(op, DisaggArmFault):
            self.workers.transport.arm(op.kind)
        else:
            raise TypeError(f"unknown disaggregated operation {op!r}")

    def _submit(self, op: DisaggSubmit) -> None:
        if op.request_id in self.tracks:
            raise ValueError(f"request id {op.request_id!r} used twice")
        prompt = prompt_for(op, PROMPT_SEED, self._shared, self.model.config.vocab_size)
        self.tracks[op.request_id] = Track(prompt, len(prompt), op.max_new, None)
        request = Request(op.request_id, prompt, op.max_new)
        self.call("add_request", request)
        self.checkers.notify(Submitted(request))

    def _abort(self, rid: str) -> None:
        t = self.tracks.get(rid)
        if t is None or t.done:
            return
        t.done = True
        self.call("abort", rid)
        self.checkers.notify(Aborted(rid))

    def _step(self) -> None:
        plan = self.call("schedule", 1 << 30)
        if not isinstance(plan, DisaggPlan):
            self.fail("contract", f"schedule() returned {type(plan).__name__}, not DisaggPlan")
        self.step_no += 1
        self.history.record(DisaggPlanned(plan))
        self.checkers.notify(DisaggScheduled(plan))
        w = self.workers
        sampled: dict[str, int] = {}
        try:
            for z in plan.zero:
                self._memory(z.worker, "zero region").zero(z.offset, z.length)
            for t in plan.transfers:
                self._check_transfer(t)
                w.transport.submit(t)
                submitted = TransferSubmitted(t)
                self.history.record(submitted)
                self.checkers.notify(submitted)
            self.in_flight = tuple(f.transfer for f in w.transport._flights)
            notices = w.transport.progress()
            for rs in plan.requests:
                self._run(rs, sampled)
        except ContractError as e:
            self.fail("contract", str(e))
        for n in notices:
            received = NoticeReceived(n)
            self.history.record(received)
            self.checkers.notify(received)
        finished = list(self.call("update", plan, DisaggResult(sampled, tuple(notices))) or ())
        for rid, tok in sampled.items():
            self.tracks[rid].tokens += (tok,)
            self.tracks[rid].generated += 1
        for rid in finished:
            done = self.tracks.get(rid)
            if done is None:
                self.fail("contract", f"update() reported {rid!r} finished, but it was never submitted")
            if done.generated < done.max_new:
                self.fail("contract", f"{rid} reported finished after {done.generated} of {done.max_new} tokens")
            done.done = True
        self.history.finished(finished)
        self.checkers.notify(DisaggStepRecord(self.step_no, plan, tuple(sampled.items()), tuple(finished),
                                              tuple(notices)))

    def _memory(self, worker: str, what: str) -> WorkerMemory:
        if worker not in WORKERS:
            raise ContractError(f"{what}: worker {worker!r} (disaggregated plans name prefill or decode)")
        return self.workers.of(worker)

    def _check_transfer(self, t: DisaggTransfer) -> None:
        """Contract: a transfer's destination ranges are disjoint (two writes of the
        same bytes in one transfer have no defined order: NIXL posts them concurrently)."""
        if t.request_id not in self.tracks or self.tracks[t.request_id].done:
            self.fail("contract", f"transfer {t.id} for unknown or finished request {t.request_id}")
        spans = sorted((d.dst_offset, d.dst_offset + d.length) for c in t.chunks for d in c)
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1:
                self.fail("contract", f"transfer {t.id} ({t.request_id}): destination ranges [{a0}, {a1}) and "
                                      f"[{b0}, {b1}) overlap at {self.workers.decode.where(b0)}")

    def _run(self, rs: RequestStep, sampled: dict[str, int]) -> None:
        """One worker-tagged request step: executed, measured, shown to the checkers."""
        t = self.tracks.get(rs.request_id)
        if t is None or t.done:
            self.fail("contract", f"step for unknown or finished request {rs.request_id}")
        if rs.worker not in (PREFILL, DECODE):
            self.fail("contract", f"{rs.request_id}: worker {rs.worker!r} (disaggregated steps name prefill or decode)")
        seq = t.tokens
        ex = run_step(self.model, self.workers.of(rs.worker), rs, seq, tile_kernel=rs.worker == DECODE)
        oracle = self.prefill_oracle if rs.worker == PREFILL else self.oracle
        computed = WorkerComputed(rs.worker, rs, seq, ex.logits, oracle.judge(seq, rs.start, ex.logits),
                                  tuple(ex.stale))
        self.history.judged(rs, computed.verdict, computed.reads, rs.worker)
        self.checkers.notify(computed)
        if rs.worker == DECODE and rs.end == len(seq) and t.generated < t.max_new:
            sampled[rs.request_id] = self.oracle.next_token(seq)

    def _drain(self) -> None:
        """Steps until every request finished and no transfer is in flight; then idle
        steps (at most IDLE_STEPS) while the implementation still holds decode pages,
        as an engine keeps stepping while a receive it gave up on may still land;
        then the checkers see it at rest."""
        tr = self.workers.transport
        for _ in range(MAX_DRAIN_STEPS):
            if not self.active() and not tr.in_flight() and not tr._held:
                break
            self._step()
        else:
            self.fail("stall", f"requests still running after {MAX_DRAIN_STEPS} steps: {self.active()}")
        for _ in range(IDLE_STEPS):
            view = self._view()
            if not isinstance(view, dict) or not view.get("decode_used"):
                break
            self._step()
        self.checkers.notify(DisaggSettled(self._view()))

    def _view(self) -> dict | None:
        """The implementation's view (optional: None without one)."""
        return self.call("view") if callable(getattr(self.impl, "view", None)) else None


class DisaggSessionObservation:
    """The read-only face of a disaggregated session its checkers see
    (:class:`~conformance.harness.disagg.observation.DisaggObservation`)."""

    __slots__ = ("_s", "_tracks", "_memories")

    def __init__(self, session: DisaggSession):
        self._s = session
        self._tracks = MappingProxyType(session.tracks)
        self._memories = MappingProxyType({PREFILL: session.workers.prefill, DECODE: session.workers.decode})

    @property
    def layouts(self) -> DisaggLayouts:
        return self._s.layouts

    @property
    def memories(self) -> Mapping[str, WorkerMemory]:
        return self._memories

    @property
    def tracks(self) -> Mapping[str, Track]:
        return self._tracks

    @property
    def history(self) -> Record:
        return self._s.history

    @property
    def step_no(self) -> int:
        return self._s.step_no

    @property
    def transport(self) -> str:
        return self._s.transport_name

    @property
    def in_flight(self) -> tuple[DisaggTransfer, ...]:
        return self._s.in_flight

    def active(self) -> list[str]:
        return self._s.active()


def make_disagg_session(disagg_factory: Any, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
                        checkers: list[BaseChecker], transport: str = "auto", faults: tuple[FaultSpec, ...] = (),
                        pool: WorkerPool | None = None, timeout: float | None = 30.0) -> DisaggSession:
    """Build the implementation (guarded) and a session over it judged by
    ``checkers`` (compose them with :func:`conformance.judge.disagg.disagg_checkers`)."""
    impl = guarded(f"building {getattr(disagg_factory, '__name__', disagg_factory)}", disagg_factory, impl_config,
                   timeout=timeout)
    return DisaggSession(impl, model, oracle, CheckerSet(list(checkers)), transport, tuple(faults), pool, timeout)
