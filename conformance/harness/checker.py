"""The one checker protocol: every judgement of a session is a named checker.

The session executes, records what happened in its history and hands each
event to its checkers, in the order they were composed (Jepsen's composed
checkers; TigerBeetle's one checker per concern).  A checker reads what the
harness knows (memory, the oracle, the plan, the implementation's stated view)
and raises :class:`~conformance.errors.ConformanceFailure` for what is wrong.

A checker that crashes (any other exception) is a harness error, never a
pass: :class:`CheckerSet` turns it into :class:`~conformance.errors.HarnessError`
naming the checker and the phase.

Phases, in the order a session meets them:

- ``attached(session)``: once, when the checker joins a built session;
- ``submitted(session, request)``: a request was added;
- ``scheduled(session, plan, view)``: ``schedule()`` returned ``plan``; ``view``
  is the implementation's view right after it; nothing ran yet;
- ``computed(session, executed)``: one request's step ran (its logits are in
  ``executed``); called before ``update()`` hears of it;
- ``stepped(session, record)``: the step is over (``update()`` returned);
- ``settled(session, view, idle)``: memory at rest after a step, a
  transfer-only step or an abort; ``idle``: nothing active or in flight;
- ``aborted(session, request_id)``.

This module imports nothing of the judges (they import it): the harness
stays below the checkers in the layering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conformance.contract import CacheView, Request, StepPlan, TransferDone
from conformance.errors import ConformanceFailure, HarnessError, ImplementationError

if TYPE_CHECKING:  # only for annotations: the session imports this module
    from conformance.harness.runner import Executed
    from conformance.harness.session import Session

PHASES = ("attached", "submitted", "scheduled", "computed", "stepped", "settled", "aborted")


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


class Checker:
    """Base class: every phase is a no-op; a checker overrides the ones it judges."""

    name = "checker"

    def attached(self, session: Session) -> None: ...

    def submitted(self, session: Session, request: Request) -> None: ...

    def scheduled(self, session: Session, plan: StepPlan, view: CacheView) -> None: ...

    def computed(self, session: Session, executed: Executed) -> None: ...

    def stepped(self, session: Session, record: StepRecord) -> None: ...

    def settled(self, session: Session, view: CacheView, idle: bool) -> None: ...

    def aborted(self, session: Session, request_id: str) -> None: ...


@dataclass
class CheckerSet:
    """Checkers composed in order; the first failure stops the step."""

    checkers: list[Checker] = field(default_factory=list)

    def add(self, checker: Checker) -> None:
        self.checkers.append(checker)

    def names(self) -> list[str]:
        return [c.name for c in self.checkers]

    def notify(self, phase: str, session: Session, *args) -> None:
        for checker in self.checkers:
            method = getattr(checker, phase)
            try:
                method(session, *args)
            except (ConformanceFailure, ImplementationError):
                raise
            except Exception as exc:  # noqa: BLE001 - a crashing checker is a harness error, never a pass
                raise HarnessError(f"checker {checker.name!r} crashed in {phase}: "
                                   f"{type(exc).__name__}: {exc}") from exc
