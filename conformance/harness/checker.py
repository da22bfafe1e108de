"""The one checker protocol: every judgement of a session is a named checker.

The session executes, records what happened in its history and shows each
moment of a session to its checkers, in the order they were composed
(Jepsen's composed checkers; TigerBeetle's one checker per concern).  A
checker folds over those events with a read-only
:class:`~conformance.harness.observation.Observation` of the session (memory,
layout, tracks, the record, the host store): it keeps its own state, counts
its own coverage (``self.coverage``), says what it could not check
(``self.notes``), and raises :class:`~conformance.errors.ConformanceFailure`
for what is wrong.  It never writes into the session: the session collects
what its checkers counted and noted (:meth:`CheckerSet.coverage`,
:meth:`CheckerSet.notes`).

A checker that crashes (any other exception) is a harness error, never a
pass: :class:`CheckerSet` turns it into :class:`~conformance.errors.HarnessError`
naming the checker and the phase.

Phases, in the order a session meets them, each with its event:

- ``attached(obs)``: once, when the checker joins a built session;
- ``submitted(obs, Submitted)``: a request was added;
- ``scheduled(obs, Scheduled)``: ``schedule()`` returned a plan; its view is
  the implementation's view right after it (None: a stall, nothing changed);
  nothing ran yet;
- ``computed(obs, Executed)``: one request's step ran (its logits, what it
  read and the oracle's verdict are in the event); before ``update()`` hears
  of it;
- ``stepped(obs, StepRecord)``: the step is over (``update()`` returned);
- ``settled(obs, Settled)``: memory at rest after a step, a transfer-only
  step or an abort; ``idle``: nothing active or in flight;
- ``aborted(obs, Aborted)``;
- ``probed(obs, ProbeStep | ProbeStall)``: the pool probe's moments
  (:mod:`conformance.harness.pool_probe`; its steps are dry: capacity, not
  logits), from which :mod:`conformance.judge.lifetime` makes its verdict.

Those moments carry what the record (:mod:`conformance.harness.history`) does
not keep (views, logits); the record's own events are in ``obs.history``.

The disaggregated session meets the same protocol (this ``CheckerSet``,
:class:`BaseChecker`) with moments and phases of its own
(:mod:`conformance.harness.disagg.checker`).

This module imports nothing of the judges (they import it) nor of the
session (which imports it): the harness stays below the checkers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conformance.contract import CacheView, Request, StepPlan, TransferDone
from conformance.errors import ConformanceFailure, HarnessError, ImplementationError
from conformance.harness.ops import Probe
from conformance.harness.runner import Executed

if TYPE_CHECKING:
    from conformance.harness.observation import Observation

PHASES = ("attached", "submitted", "scheduled", "computed", "stepped", "settled", "aborted", "probed")


# -- the moments a checker is shown ---------------------------------------------------------
@dataclass(frozen=True)
class Submitted:
    request: Request


@dataclass(frozen=True)
class Scheduled:
    plan: StepPlan
    view: CacheView | None  # right after schedule(); None: a stall (nothing scheduled, nothing moved)


@dataclass(frozen=True)
class StepRecord:
    """One executed step, as the checkers of ``stepped`` see it."""

    number: int  # the session's step number, 1-based
    plan: StepPlan
    view_before: CacheView | None  # the view after the previous step (None before the first)
    view_at_schedule: CacheView | None  # right after schedule()
    view_after: CacheView | None  # after update()
    finished: tuple[str, ...] = ()
    transfers: tuple[TransferDone, ...] = ()


@dataclass(frozen=True)
class Settled:
    view: CacheView
    idle: bool  # no request active and no transfer in flight


@dataclass(frozen=True)
class Aborted:
    request_id: str


@dataclass(frozen=True)
class ProbeStep:
    """The pool probe's concurrent part ran one step: ``plan`` is what the
    implementation scheduled of the short requests ``ids`` submitted together."""

    probe: Probe
    ids: tuple[str, ...]
    plan: StepPlan


@dataclass(frozen=True)
class ProbeStall:
    """A part of the pool probe could not be served: its drain stalled.

    ``part``: ``"concurrent"`` (the short requests) or ``"long"`` (the
    ``probe.kv_tokens``-token request); ``held``: the longest proper prefix of
    the long prompt whose state a slot held when it was submitted (memory's
    provenance; 0 for the concurrent part); ``stall``: the stall's message."""

    probe: Probe
    part: str
    requests: int
    held: int
    stall: str


#: The phase that shows each kind of event.
PHASE_OF: dict[type, str] = {Submitted: "submitted", Scheduled: "scheduled", Executed: "computed",
                             StepRecord: "stepped", Settled: "settled", Aborted: "aborted",
                             ProbeStep: "probed", ProbeStall: "probed"}


class BaseChecker:
    """What every checker is, of either family: a name, its own coverage and
    notes, and ``attached``.  A checker of one worker's session is a
    :class:`Checker`; one of a disaggregated session a
    :class:`~conformance.harness.disagg.checker.DisaggChecker`."""

    name = "checker"
    #: The phases this class declares are no-ops (a base class's): a set skips them.
    _phases_are_no_ops = True

    def __init__(self) -> None:
        self.coverage: dict[str, int] = {}
        self.notes: set[str] = set()

    def count(self, key: str, n: int = 1) -> None:
        self.coverage[key] = self.coverage.get(key, 0) + n

    def attached(self, obs: Any) -> None: ...

    @classmethod
    def judges(cls, phase: str) -> bool:
        """Whether this class overrides ``phase`` (a base class's no-op does not)."""
        for klass in cls.__mro__:
            if phase in vars(klass):
                return not vars(klass).get("_phases_are_no_ops", False)
        return False


class Checker(BaseChecker):
    """Base class of a single-worker session's checkers: every phase is a
    no-op; a checker overrides the ones it judges.

    What it counts goes to ``self.coverage`` (:meth:`count`), what it could
    not check to ``self.notes``: its own, read by the session."""

    _phases_are_no_ops = True

    def attached(self, obs: Observation) -> None: ...

    def submitted(self, obs: Observation, ev: Submitted) -> None: ...

    def scheduled(self, obs: Observation, ev: Scheduled) -> None: ...

    def computed(self, obs: Observation, executed: Executed) -> None: ...

    def stepped(self, obs: Observation, record: StepRecord) -> None: ...

    def settled(self, obs: Observation, ev: Settled) -> None: ...

    def aborted(self, obs: Observation, ev: Aborted) -> None: ...

    def probed(self, obs: Observation, ev: ProbeStep | ProbeStall) -> None: ...


@dataclass
class CheckerSet:
    """Checkers composed in order; the first failure stops the step.
    ``phases``: the phase that shows each kind of moment (:data:`PHASE_OF`;
    a disaggregated session's are its own)."""

    checkers: list[Any] = field(default_factory=list)  # BaseChecker subclasses of one family
    obs: Any = None  # the observation they are shown (set by attach)
    phases: Mapping[type, str] = field(default_factory=lambda: PHASE_OF)
    # per phase, the checkers that judge it, in order (most checkers judge two or
    # three of the eight phases, and a session shows thousands of moments)
    _routes: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    def attach(self, obs: Any, checkers: list[Any] | None = None) -> None:
        """Show the session to ``checkers`` (all of them by default; a checker
        added later is attached alone)."""
        self.obs = obs
        for checker in self.checkers if checkers is None else checkers:
            self._call(checker, "attached", checker.attached, obs)

    def add(self, checker: BaseChecker) -> None:
        self.checkers.append(checker)
        self._routes.clear()
        if self.obs is not None:
            self.attach(self.obs, [checker])

    def names(self) -> list[str]:
        return [c.name for c in self.checkers]

    def notify(self, event: object) -> None:
        phase = self.phases[type(event)]
        route = self._routes.get(phase)
        if route is None:
            route = self._routes[phase] = [c for c in self.checkers
                                           if not hasattr(type(c), "judges") or type(c).judges(phase)]
        for checker in route:
            self._call(checker, phase, getattr(checker, phase), self.obs, event)

    @staticmethod
    def _call(checker: BaseChecker, phase: str, method: Callable, *args: object) -> None:
        try:
            method(*args)
        except (ConformanceFailure, ImplementationError):
            raise
        except Exception as exc:  # noqa: BLE001 - a crashing checker is a harness error, never a pass
            raise HarnessError(f"checker {checker.name!r} crashed in {phase}: "
                               f"{type(exc).__name__}: {exc}") from exc

    # -- what the checkers counted and noted (the session's coverage and notes) ----------------
    def coverage(self) -> dict[str, int]:
        """Every checker's counters, summed by name (two checkers of one
        concern, say the retention and hit-rate families, count together)."""
        out: dict[str, int] = {}
        for checker in self.checkers:
            for key, n in getattr(checker, "coverage", {}).items():
                out[key] = out.get(key, 0) + n
        return out

    def notes(self) -> set[str]:
        return set().union(*(getattr(c, "notes", set()) for c in self.checkers))
