"""A session: one implementation, one memory, one model, one oracle, and the
checkers that judge it.

It applies operations (:mod:`conformance.harness.ops`), drives the
implementation step by step, executes each plan with the runner and records
everything in its history; after each phase it hands what happened to its
checkers (:mod:`conformance.harness.checker`), which raise
:class:`~conformance.errors.ConformanceFailure` for what is wrong.  The
session itself enforces only the contract (ids, ranges, return types) and
liveness (a stall); every other judgement is a checker's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.contract import (
    CacheImplementation,
    CacheView,
    ContractError,
    ImplConfig,
    Layout,
    Request,
    StepPlan,
    StepResult,
    missing_methods,
)
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker, CheckerSet, StepRecord
from conformance.harness.guard import guarded
from conformance.harness.history import History
from conformance.harness.memory import Memory
from conformance.harness.ops import Abort, Deliver, Drain, HoldTransfers, Op, Step, StoreEvict, Submit
from conformance.harness.oracle import Oracle
from conformance.harness.runner import Runner
from conformance.harness.transfer_control import TransferControl
from conformance.model import TinyHybrid

MAX_DRAIN_STEPS = 400
STALL_STEPS = 3


@dataclass
class Track:
    """The harness's own record of one request: its tokens and progress."""

    tokens: tuple[int, ...]
    prompt_len: int
    max_new: int
    continues: str | None
    generated: int = 0
    computed: int | None = None  # None until first scheduled
    steps: int = 0
    done: bool = False


@dataclass
class Session:
    impl: CacheImplementation
    model: TinyHybrid
    oracle: Oracle
    checkers: CheckerSet
    timeout: float | None = 30.0
    history: History = field(default_factory=History)
    # Coverage counters: the checkers count them (conformance.judge.coverage);
    # checks require some of them to be > 0.
    coverage: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = missing_methods(self.impl)
        if missing:
            raise TypeError(f"{type(self.impl).__name__} does not meet the contract: missing {', '.join(missing)}")
        self.layout: Layout = self.call("layout")
        if not isinstance(self.layout, Layout):
            raise ConformanceFailure("contract", f"layout() returned {type(self.layout).__name__}, not Layout")
        self.memory = Memory(self.layout, self.model.config, self.model.dtype, str(self.model.device))
        self.runner = Runner(self.model, self.memory)
        self.runner.transport.history = self.history
        self.tracks: dict[str, Track] = {}
        self.step_no = 0  # schedule() calls so far: the step a fault trigger or an event names
        self._stalled = 0  # consecutive steps that scheduled nothing
        self.last_view: CacheView | None = None  # the view after the latest step or abort
        self.plan_view: CacheView | None = None  # the view taken right after the latest schedule()
        self.checkers.notify("attached", self)

    def add_checker(self, checker: Checker) -> None:
        self.checkers.add(checker)
        CheckerSet([checker]).notify("attached", self)

    # -- operations ------------------------------------------------------------------
    def apply(self, op: Op) -> None:
        self.history.begin(op)
        if isinstance(op, Submit):
            self._submit(op)
        elif isinstance(op, Step):
            self._step(op.budget)
        elif isinstance(op, Drain):
            self._drain(op.budget)
        elif isinstance(op, Abort):
            self._abort(op.request_id)
        elif isinstance(op, HoldTransfers):
            self.control.hold()
        elif isinstance(op, Deliver):
            self.control.deliver(self.runner.transport, op.pick, op.outcome, op.delay)
        elif isinstance(op, StoreEvict):
            self.control.store_evict(self.runner.transport, op.pick)
        else:
            raise TypeError(f"unknown operation {op!r}")

    @property
    def control(self) -> TransferControl:
        """The transport's decisions as operations (installed on first use)."""
        return TransferControl.of(self.runner.transport)

    def pending_loads(self) -> list:
        """Loads issued and not completed yet, by transfer id."""
        return TransferControl.pending(self.runner.transport)

    def active(self) -> list[str]:
        return [rid for rid, t in self.tracks.items() if not t.done]

    def idle(self) -> bool:
        """No request active and no transfer in flight (memory held for one is not leaked)."""
        return not self.active() and not self.runner.transport.busy()

    def _submit(self, op: Submit) -> None:
        if op.request_id in self.tracks:
            raise ValueError(f"request id {op.request_id!r} used twice")
        bad = [t for t in op.prompt if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt tokens {bad[:3]} outside the vocabulary of {self.model.config.vocab_size}")
        self.tracks[op.request_id] = Track(op.prompt, len(op.prompt), op.max_new_tokens, op.continues)
        self.oracle.prime(op.prompt)
        request = Request(op.request_id, op.prompt, op.max_new_tokens)
        self.call("add_request", request)
        self.checkers.notify("submitted", self, request)

    def _abort(self, rid: str) -> None:
        track = self.tracks.get(rid)
        if track is None or track.done:
            return
        self.call("abort", rid)
        track.done = True
        self.checkers.notify("aborted", self, rid)
        self._settle()

    def _drain(self, budget: int) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.active():
                return
            self._step(budget)
        raise ConformanceFailure("stall", f"requests {self.active()} still active after {MAX_DRAIN_STEPS} steps")

    # -- one engine step --------------------------------------------------------------
    def _step(self, budget: int) -> None:
        if not self.active():
            return
        view_before = self.last_view
        plan: StepPlan = self.call("schedule", budget)
        if not isinstance(plan, StepPlan):
            raise ConformanceFailure("contract", f"schedule() returned {type(plan).__name__}, not StepPlan")
        self.step_no += 1
        self.history.plan(plan)
        if not plan.requests:
            self._without_requests(plan)
            return
        self._stalled = 0
        view = self.plan_view = self.call("view")
        self._validate(plan)
        self.checkers.notify("scheduled", self, plan, view)
        try:
            executed = self.runner.execute(plan, {rid: t.tokens for rid, t in self.tracks.items()})
        except ContractError as exc:
            raise ConformanceFailure("contract", str(exc)) from None
        self._record_transfers()
        sampled = {}
        for ex in executed:
            self.checkers.notify("computed", self, ex)
            rs, track = ex.step, self.tracks[ex.step.request_id]
            track.computed = rs.end
            track.steps += 1
            if rs.end == len(track.tokens) and track.generated < track.max_new:
                tok = self.oracle.next_token(track.tokens)
                track.tokens += (tok,)
                track.generated += 1
                sampled[rs.request_id] = tok
        finished = self.call("update", plan, StepResult(sampled, transfers=tuple(self.runner.completed)))
        self._finish(list(finished or ()))
        view_after = self._settle()
        self.checkers.notify("stepped", self, StepRecord(self.step_no, plan, view_before, view, view_after,
                                                         tuple(finished or ()), tuple(self.runner.completed)))

    def _without_requests(self, plan: StepPlan) -> None:
        """A plan that computes nothing: transfers and copies only, or a stall."""
        self.checkers.notify("scheduled", self, plan, None)
        if plan.transfers or plan.kv_copies or plan.state_copies or self.runner.transport.busy():
            # requests wait for their loads (or copies prepare them): progress, not a stall
            self._stalled = 0
            try:
                self.runner.execute(plan, {})
            except ContractError as exc:
                raise ConformanceFailure("contract", str(exc)) from None
            self._record_transfers()
            if self.call("update", plan, StepResult(transfers=tuple(self.runner.completed))):
                raise ConformanceFailure("contract", "update() finished requests in a step that computed nothing")
            self._settle()
            return
        self._stalled += 1
        if self._stalled >= STALL_STEPS:
            raise ConformanceFailure("stall", f"{len(self.active())} requests active but nothing was scheduled "
                                              f"for {STALL_STEPS} steps")

    def _finish(self, finished: list[str]) -> None:
        for rid in finished:
            track = self.tracks.get(rid)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"update() reported {rid!r} finished, but it is not active")
            if track.generated < track.max_new:
                raise ConformanceFailure("contract", f"update() finished {rid!r} after {track.generated} of "
                                                     f"{track.max_new} tokens")
            track.done = True
        self.history.finished(finished)
        late = [rid for rid, t in self.tracks.items() if not t.done and t.generated >= t.max_new]
        if late:
            raise ConformanceFailure("contract", f"requests {late} generated all their tokens but update() did "
                                                 f"not report them finished")

    def _record_transfers(self) -> None:
        for done in self.runner.completed:
            self.history.completed(done)

    def _settle(self) -> CacheView:
        """Memory at rest: the view after it, handed to the checkers."""
        view = self.last_view = self.call("view")
        self.checkers.notify("settled", self, view, self.idle())
        return view

    def _validate(self, plan: StepPlan) -> None:
        for rs in plan.requests:
            track = self.tracks.get(rs.request_id)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"scheduled {rs.request_id!r}, which is not active")
            if track.computed is None:
                if rs.start >= track.prompt_len:
                    raise ConformanceFailure("contract", f"{rs.request_id}: first step starts at {rs.start}, but "
                                                         f"the prompt has {track.prompt_len} tokens")
            elif rs.start > track.computed:
                raise ConformanceFailure("contract", f"{rs.request_id}: step starts at {rs.start}, but only "
                                                     f"{track.computed} tokens were computed")

    def call(self, method: str, *args):
        """Call the implementation, guarded: a raise or a hang becomes an ImplementationError."""
        return guarded(f"{type(self.impl).__name__}.{method}()", getattr(self.impl, method), *args,
                       timeout=self.timeout)



def make_session(impl_factory, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
                 checkers: list[Checker], timeout: float | None = 30.0) -> Session:
    """Build the implementation (guarded) and a session judged by ``checkers``
    (compose them with :func:`conformance.judge.standard_checkers`)."""
    impl = guarded(f"building {getattr(impl_factory, '__name__', impl_factory)}", impl_factory, impl_config,
                   timeout=timeout)
    return Session(impl, model, oracle, CheckerSet(list(checkers)), timeout=timeout)
