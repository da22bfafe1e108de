"""What the examples of one check produced, collected as they run: how many
examples and operations, the coverage counters summed over them, the notes
(reduced assurance), the last failure and when the first appeared."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conformance.judge.coverage import COUNTERS


@dataclass
class Recorder:
    """What the runs of one check produced: counts, coverage, the last failure."""

    examples: int = 0
    steps: int = 0
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    failure: tuple | None = None  # (exception, ops as data, events)
    notes: set[str] = field(default_factory=set)  # reduced assurance the checkers reported
    on_example: Callable[[Recorder], None] | None = None  # progress callback
    started: float = field(default_factory=time.perf_counter)
    # When the first failing example appeared (before shrinking): detection cost.
    first_failure: tuple[int, float] | None = None  # (examples run, seconds)
    # Known defects met (``known`` of the machine): defect id -> what the first
    # example that met it recorded, and how many examples met it.
    known: dict[str, KnownMet] = field(default_factory=dict)

    def met(self, defect, exc: Exception, ops: list[dict], events: list[dict]) -> None:
        seen = self.known.get(defect.id)
        if seen is None:
            self.known[defect.id] = KnownMet(defect, getattr(exc, "kind", "raised"), str(exc), ops, events,
                                             self.examples, round(time.perf_counter() - self.started, 3))
        else:
            seen.count += 1


@dataclass
class KnownMet:
    """A known defect met while exploring: the first example that met it (its
    operations, to be minimized into the check's repro of it) and a count."""

    defect: Any  # conformance.results.defects.Defect
    kind: str
    message: str
    ops: list[dict]
    events: list[dict]
    example: int  # examples run when it was first met
    seconds: float
    count: int = 1
