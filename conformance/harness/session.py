"""A session: one implementation, one memory, one model, one oracle, and the
checkers that judge it.

It applies operations (:mod:`conformance.harness.ops`), drives the
implementation step by step, executes each plan with the runner and records
everything in its history; after each phase it shows what happened to its
checkers (:mod:`conformance.harness.checker`), with a read-only observation of
itself (:class:`SessionObservation`), and they raise
:class:`~conformance.errors.ConformanceFailure` for what is wrong.  The
session itself enforces only the contract (ids, ranges, return types) and
liveness (a stall); every other judgement is a checker's.  It measures (the
oracle's verdict on each computed step, the entries evicted so far) and
collects what its checkers counted and noted (``coverage``, ``notes``); it
never asks a checker's counters what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from conformance.contract import (
    OPTIONAL_METHODS,
    CacheImplementation,
    CacheView,
    ContractError,
    ImplConfig,
    ImplFactory,
    Layout,
    Request,
    StepPlan,
    StepResult,
    Transfer,
    missing_methods,
)
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Aborted, Checker, CheckerSet, Scheduled, Settled, StepRecord, Submitted
from conformance.harness.conflicts import plan_conflicts
from conformance.harness.guard import guarded
from conformance.harness.history import History
from conformance.harness.memory import Memory, Prefix
from conformance.harness.observation import Track
from conformance.harness.ops import Abort, Deliver, Drain, HoldTransfers, Op, Probe, Step, StoreEvict, Submit
from conformance.harness.oracle import Oracle
from conformance.harness.probe import SHORT_LEN, probe_prompts
from conformance.harness.runner import Runner
from conformance.harness.transfer_control import TransferControl
from conformance.harness.transport import HostStore
from conformance.model import TinyHybrid

MAX_DRAIN_STEPS = 400
STALL_STEPS = 3


@dataclass
class Session:
    impl: CacheImplementation
    model: TinyHybrid
    oracle: Oracle
    checkers: CheckerSet
    timeout: float | None = 30.0
    history: History = field(default_factory=History)

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
        self.last_plan: StepPlan | None = None  # the plan of the latest schedule()
        self.probing = False  # while the pool probe runs (coverage does not count its requests)
        self._probes = 0
        self.ended = False  # after the pool probe (see _probe)
        # Cached entries the view stopped listing, outside the probe (a fact the
        # generator steers on and the coverage reports; see _settle).
        self.evicted = 0
        self._cached: set[tuple] = set()
        self.observation = SessionObservation(self)
        self.checkers.attach(self.observation)

    def add_checker(self, checker: Checker) -> None:
        self.checkers.add(checker)

    @property
    def coverage(self) -> dict[str, int]:
        """What the checkers counted (checks require some counters to be > 0)."""
        return self.checkers.coverage()

    @property
    def notes(self) -> set[str]:
        """What the checkers could not check for this implementation (reduced
        assurance, e.g. no refcounts stated): reported with the result, never silent."""
        return self.checkers.notes()

    # -- operations ------------------------------------------------------------------
    def apply(self, op: Op) -> None:
        if self.ended:
            raise ValueError("the pool probe ends a session: no operation may follow it")
        self.history.begin(op)
        if isinstance(op, Submit):
            self._submit(op)
        elif isinstance(op, Step):
            self._step(op.budget)
        elif isinstance(op, Drain):
            self._drain(op.budget)
        elif isinstance(op, Abort):
            self._abort(op.request_id)
        elif isinstance(op, Probe):
            self._probe(op)
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
        self.checkers.notify(Submitted(request))

    def _abort(self, rid: str) -> None:
        track = self.tracks.get(rid)
        if track is None or track.done:
            return
        self.call("abort", rid)
        track.done = True
        self.checkers.notify(Aborted(rid))
        self._settle()

    def _drain(self, budget: int) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.active():
                return
            self._step(budget)
        raise ConformanceFailure("stall", f"requests {self.active()} still active after {MAX_DRAIN_STEPS} steps")

    def _probe(self, op: Probe) -> None:
        """The pool probe, a black-box lifetime check that believes nothing the
        implementation says about itself: finish what is active; then, at idle,
        ``op.concurrent`` short requests submitted together must be scheduled in
        one step at least ``op.expect`` at a time, and one ``op.kv_tokens``-token
        request must be served, as a fresh instance of the implementation does
        (the numbers are measured on one, :mod:`conformance.generate.probe`).
        Its steps are dry (the model is not run, nothing of memory's bytes
        changes, only provenance): it ends the session.
        A KV block or state slot held by nothing (leaked) makes that
        impossible: an ``invariant`` failure whose message starts "lifetime:".
        One that a transfer holds (of the probe's step: an offload the cache
        queued at idle; or still in flight) is held, not leaked: it is
        counted, and named in the message.
        The concurrent part is inconclusive when a probe request reuses a
        cached prefix (a hit may pin what it reuses)."""
        self._drain(1024)
        self.probing = self.runner.dry = True  # capacity, not logits: the steps are not computed
        self._probes += 1
        lay = self.layout
        short, long = probe_prompts(self.model.config.vocab_size, op.kv_tokens, op.concurrent)
        leaked = "KV blocks or state slots are held by nothing (leaked)"
        try:
            ids = [f"probe{self._probes}-c{i}" for i in range(len(short))]
            for rid, prompt in zip(ids, short, strict=True):
                self._submit(Submit(rid, prompt, 1))
            if ids:
                self.last_plan = None
                self._step(SHORT_LEN * len(ids))
                plan = self.last_plan or StepPlan()
                ran = [rs for rs in plan.requests if rs.request_id in ids]
                # Inconclusive when a probe request reuses a cached prefix or waits
                # for a load: a correct cache may then pin more, or admit later.
                reused = any(rs.start > 0 for rs in ran) or any(t.direction == "load" for t in plan.transfers)
                # A transfer of that step, or one still in flight, holds its block or
                # slot until it completes (an offload the cache queued at idle): each
                # may keep one request out, and is no leak.
                moving = sorted({(t.kind, t.device, t.direction)
                                 for t in (*plan.transfers, *self.runner.transport.deferred)})
                if len(ran) + len(moving) < op.expect and not reused:
                    holders = ""
                    if moving:
                        what = ", ".join(f"{'KV block' if k == 'kv' else 'state slot'} {d} ({direction})"
                                         for k, d, direction in moving[:4]) + (" ..." if len(moving) > 4 else "")
                        holders = (f"; transfers of that step or in flight held {len(moving)} ({what}), and "
                                   f"{op.expect - len(ran) - len(moving)} more")
                    raise ConformanceFailure("invariant", f"lifetime: at idle, {len(ran)} of {len(ids)} "
                                                          f"{SHORT_LEN}-token requests submitted together were "
                                                          f"scheduled in one step; a fresh instance schedules "
                                                          f"{op.expect}{holders}: {leaked}")
                self._probe_drain(f"{len(ids)} {SHORT_LEN}-token requests", leaked)
            if op.kv_tokens:
                self._submit(Submit(f"probe{self._probes}-kv", long, 1))
                need = -(-op.kv_tokens // lay.block_size)
                # Not only a leak starves it: a cache whose hit on a held prefix needs
                # more of the pool than recomputing (a copy-on-write of a partial
                # block) and that never recomputes instead waits forever at idle too.
                held = self._held_prefix(long)
                why = leaked if not held else (f"{leaked}, or a hit on its first {held} tokens (a state slot "
                                               f"holds them) needs more of the pool than recomputing them "
                                               f"and the cache never recomputes instead")
                self._probe_drain(f"a {op.kv_tokens}-token request ({need} of the {lay.num_kv_blocks} KV blocks), "
                                  f"which a fresh instance serves,", why)
        finally:
            self.probing = False
            self.ended = True  # the runner stays dry: memory's bytes no longer match its provenance

    def _held_prefix(self, prompt) -> int:
        """The longest proper prefix of ``prompt`` whose state some slot holds,
        by the harness memory's provenance (not by what the view says)."""
        held = 0
        for slot in range(self.layout.num_state_slots):
            conv, ssm = self.memory.state_holds(slot)
            if conv is not None and conv == ssm and held < len(conv) < len(prompt) and prompt[:len(conv)] == conv:
                held = len(conv)
        return held

    def _probe_drain(self, what: str, why: str) -> None:
        try:
            self._drain(max(1024, SHORT_LEN * len(self.active())))
        except ConformanceFailure as exc:
            if exc.kind != "stall":
                raise
            raise ConformanceFailure("invariant", f"lifetime: at idle, {what} could not be served "
                                                  f"({exc}): "
                                                  f"{why}") from None

    # -- one engine step --------------------------------------------------------------
    def _step(self, budget: int) -> None:
        if not self.active():
            return
        view_before = self.last_view
        plan: StepPlan = self.call("schedule", budget)
        if not isinstance(plan, StepPlan):
            raise ConformanceFailure("contract", f"schedule() returned {type(plan).__name__}, not StepPlan")
        self.step_no += 1
        self.last_plan = plan
        self.history.plan(plan)
        if not plan.requests:
            self._without_requests(plan)
            return
        self._stalled = 0
        view = self.plan_view = self.call("view")
        self._validate(plan)
        self.checkers.notify(Scheduled(plan, view))
        try:
            executed = self.runner.execute(plan, {rid: t.tokens for rid, t in self.tracks.items()})
        except ContractError as exc:
            raise ConformanceFailure("contract", str(exc)) from None
        self._record_transfers()
        sampled = {}
        for ex in executed:
            rs, track = ex.step, self.tracks[ex.step.request_id]
            if ex.logits is not None:  # the oracle's verdict, recorded; the logits checker judges it
                verdict = self.oracle.judge(track.tokens, rs.start, ex.logits)
                self.history.judged(rs, verdict, ex.reads)
                ex = replace(ex, verdict=verdict)
            self.checkers.notify(ex)
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
        self.checkers.notify(StepRecord(self.step_no, plan, view_before, view, view_after, tuple(finished or ()),
                                        tuple(self.runner.completed)))

    def _without_requests(self, plan: StepPlan) -> None:
        """A plan that computes nothing: transfers and copies only, or a stall."""
        progress = bool(plan.transfers or plan.kv_copies or plan.state_copies or self.runner.transport.busy())
        # Requests that wait on loads were matched in this schedule: the
        # checkers see what the cache held then (an entry evicted by another
        # request's load destinations is neither on the device nor, its
        # offload not run yet, in the host store).
        self.checkers.notify(Scheduled(plan, self.call("view") if progress else None))
        if progress:
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
            self.history.completed(done, self.runner.transport.intact.pop(done.id, None))

    def _settle(self) -> CacheView:
        """Memory at rest: the view after it, handed to the checkers."""
        view = self.last_view = self.call("view")
        cached = ({("kv", e.block, e.tokens) for e in view.cached_kv}
                  | {("s", e.slot, e.tokens) for e in view.cached_states})
        if not self.probing:  # the probe evicts whatever it needs: not the check's pressure
            self.evicted += len(self._cached - cached)
        self._cached = cached
        self.checkers.notify(Settled(view, self.idle()))
        return view

    def _validate(self, plan: StepPlan) -> None:
        seen: set[str] = set()
        for rs in plan.requests:
            if rs.request_id in seen:
                raise ConformanceFailure("contract", f"request {rs.request_id} scheduled twice in one step")
            seen.add(rs.request_id)
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
        problems = plan_conflicts(plan, self.layout.block_size, {rs.request_id: self.tracks[rs.request_id].tokens
                                                                 for rs in plan.requests})
        if problems:  # memory two requests of the step contend for (conformance/harness/conflicts.py)
            more = f" (+{len(problems) - 2} more)" if len(problems) > 2 else ""
            raise ConformanceFailure("contract", "; ".join(problems[:2]) + more)

    def call(self, method: str, *args):
        """Call the implementation, guarded: a raise or a hang becomes an ImplementationError."""
        return guarded(f"{type(self.impl).__name__}.{method}()", getattr(self.impl, method), *args,
                       timeout=self.timeout)



class SessionObservation:
    """The read-only face of a session its checkers see
    (:class:`~conformance.harness.observation.Observation`)."""

    __slots__ = ("_s", "_tracks")

    def __init__(self, session: Session):
        self._s = session
        self._tracks = MappingProxyType(session.tracks)

    @property
    def layout(self) -> Layout:
        return self._s.layout

    @property
    def memory(self) -> Memory:
        return self._s.memory

    @property
    def tracks(self) -> Mapping[str, Track]:
        return self._tracks

    @property
    def history(self) -> History:
        return self._s.history

    @property
    def step_no(self) -> int:
        return self._s.step_no

    @property
    def probing(self) -> bool:
        return self._s.probing

    @property
    def evicted(self) -> int:
        return self._s.evicted

    @property
    def last_view(self) -> CacheView | None:
        return self._s.last_view

    @property
    def plan_view(self) -> CacheView | None:
        return self._s.plan_view

    @property
    def store(self) -> HostStore:
        return self._s.runner.transport.store

    @property
    def transfers_succeeded(self) -> Mapping[str, int]:
        return MappingProxyType(self._s.runner.transport.succeeded)

    @property
    def loaded_states(self) -> set[Prefix]:
        return self._s.runner.transport.loaded_states

    @property
    def transfer_decisions(self) -> Mapping[str, int] | None:
        control = next((h for h in self._s.runner.transport.hooks if isinstance(h, TransferControl)), None)
        return None if control is None else MappingProxyType(control.counts)

    def active(self) -> list[str]:
        return self._s.active()

    def pending_loads(self) -> list[Transfer]:
        return self._s.pending_loads()

    def declared(self, method: str) -> object:
        if method not in OPTIONAL_METHODS:
            raise ValueError(f"{method}() is not a declaration of the contract ({', '.join(OPTIONAL_METHODS)})")
        return self._s.call(method) if callable(getattr(self._s.impl, method, None)) else None


def make_session(impl_factory: ImplFactory, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
                 checkers: list[Checker], timeout: float | None = 30.0) -> Session:
    """Build the implementation (guarded) and a session judged by ``checkers``
    (compose them with :func:`conformance.judge.standard_checkers`)."""
    impl = guarded(f"building {getattr(impl_factory, '__name__', impl_factory)}", impl_factory, impl_config,
                   timeout=timeout)
    return Session(impl, model, oracle, CheckerSet(list(checkers)), timeout=timeout)
