"""Minimizes a failing operation sequence by replaying subsets of it.

Hypothesis shrinks the *choices* behind a failing example, which for a
stateful machine means re-running hundreds of sessions (tens of seconds to
minutes per failure).  The operations of a failing example are data and any
subsequence of them is a valid history (an abort or a drain of an unknown
request does nothing), so removing operations and replaying is a much
cheaper way to a short repro: typically a few dozen replays of a handful of
operations.  Used by default (``shrink="ops"``, also after Hypothesis's
shrinker with ``"hypothesis+ops"``), so that every repro a run writes is
minimal: no single operation can be removed and still fail the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conformance.errors import ConformanceFailure, ImplementationError
from conformance.harness.ops import Op
from conformance.harness.session import make_session
from conformance.judge import standard_checkers

# Why a hang's repro is not minimized, said in its check's result: every replay of a subset would wait
# out the timeout again (a hanging disaggregated adapter cost about 6x --timeout a check that way).
HANG_NOT_MINIMIZED = ("not minimized: the failure is a hang (timeout), and each replay of a shorter sequence would "
                      "wait out the timeout again; the repro holds the operations as they ran")


def replay_fails(factory, impl_config, model, oracle, ops: list[Op], attach=None,
                 timeout: float | None = 30.0, families: tuple[str, ...] = ()):
    """Apply ``ops`` to a fresh session judged by the standard checkers (and
    the retention ``families`` of the check); the failure it raises, or None.
    Returns (exception, session)."""
    session = make_session(factory, impl_config, model, oracle, standard_checkers(families), timeout=timeout)
    if attach is not None:
        attach(session)
    try:
        for op in ops:
            session.apply(op)
    except (ConformanceFailure, ImplementationError) as exc:
        return exc, session
    return None, session


def minimize(ops: list[Op], still_fails: Callable[[list[Op]], bool], budget_s: float = 60.0) -> list[Op]:
    """Greedy delta debugging: drop chunks (halves, quarters, ... single
    operations) while the failure persists, until no single removal keeps it
    or the time budget is spent (the best sequence so far is returned)."""
    deadline = time.perf_counter() + budget_s
    best = list(ops)
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.perf_counter() < deadline:
        removed = False
        i = 0
        while i < len(best) and time.perf_counter() < deadline:
            candidate = best[:i] + best[i + chunk:]
            if candidate and still_fails(candidate):
                best = candidate
                removed = True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return best
