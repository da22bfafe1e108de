"""A session: one implementation, one memory, one model, one oracle, and the
checkers that judge it.

It applies operations (:mod:`conformance.harness.ops`): this module holds
their dispatch and the small ones (submit, abort, drain, the transfer
decisions); one engine step is :mod:`conformance.harness.step`'s, the pool
probe's execution :mod:`conformance.harness.pool_probe`'s.  It drives the
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
from dataclasses import dataclass, field
from types import MappingProxyType

from conformance.contract import (
    OPTIONAL_METHODS,
    CacheImplementation,
    CacheView,
    ImplConfig,
    ImplFactory,
    Layout,
    Request,
    Speculation,
    StepPlan,
    Transfer,
    missing_methods,
)
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Aborted, Checker, CheckerSet, Settled, Submitted
from conformance.harness.guard import guarded
from conformance.harness.history import History
from conformance.harness.memory import Memory, Prefix
from conformance.harness.observation import Record, Track
from conformance.harness.ops import (
    MAX_DRAIN_STEPS,
    Abort,
    Deliver,
    Draft,
    Drain,
    HoldTransfers,
    Op,
    Probe,
    Step,
    StoreEvict,
    Submit,
)
from conformance.harness.oracle import Oracle
from conformance.harness.pool_probe import PoolProbe
from conformance.harness.runner import Runner
from conformance.harness.speculation import Speculator
from conformance.harness.step import Stepping
from conformance.harness.transfer_control import TransferControl
from conformance.harness.transport import HostStore
from conformance.model import TinyHybrid


@dataclass
class Session(Stepping, PoolProbe):
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
        self.speculator = Speculator.of(self)  # the harness as drafter and verifier (speculative decoding)
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
        elif isinstance(op, Draft):
            self.speculator.propose(self, op)
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
        self.speculator.forget(rid)
        self._settle()

    def _drain(self, budget: int) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.active():
                return
            self._step(budget)
        raise ConformanceFailure("stall", f"requests {self.active()} still active after {MAX_DRAIN_STEPS} steps")

    def _settle(self) -> CacheView:
        """Memory at rest: the view after it, handed to the checkers."""
        view = self.last_view = self._view()
        cached = ({("kv", e.block, e.tokens) for e in view.cached_kv}
                  | {("s", e.slot, e.tokens) for e in view.cached_states})
        if not self.probing:  # the probe evicts whatever it needs: not the check's pressure
            self.evicted += len(self._cached - cached)
        self._cached = cached
        self.checkers.notify(Settled(view, self.idle()))
        return view

    def call(self, method: str, *args):
        """Call the implementation, guarded: a raise or a hang becomes an ImplementationError."""
        return guarded(f"{type(self.impl).__name__}.{method}()", getattr(self.impl, method), *args,
                       timeout=self.timeout)

    def _view(self) -> CacheView:
        """The implementation's view, which the contract types as a CacheView:
        anything else (None from a view() that forgot its return) is the
        implementation's contract failure, said here, never a crash of the
        first checker that reads it (a harness error)."""
        view = self.call("view")
        if not isinstance(view, CacheView):
            raise ConformanceFailure("contract", f"view() returned {type(view).__name__}, not CacheView")
        return view



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
    def history(self) -> Record:
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

    @property
    def speculation(self) -> Speculation | None:
        return self._s.speculator.declared

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
