"""What the examples of one check produced, collected as they run: how many
examples and operations, the coverage counters summed over them, the notes
(reduced assurance), the last failure and when the first appeared."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
