"""The checkers: each judges one concern from what a session records
(:mod:`conformance.harness.checker` defines the protocol).

- :mod:`~conformance.judge.logits`: computed logits against the no-cache oracle;
- :mod:`~conformance.judge.invariants`: the implementation's view against memory;
- :mod:`~conformance.judge.lifetime`: the pool probe's verdict (a leak, whatever the view says);
- :mod:`~conformance.judge.coverage`: the situations a run reached;
- :mod:`~conformance.judge.retention`: a declared retention policy and its hit rate;
- :mod:`~conformance.judge.spec_decode`: speculative decoding (only the accepted prefix is reusable);
- :mod:`~conformance.judge.windows`: what sliding-window layers read, and the window histories reached;
- :mod:`~conformance.judge.metrics`: cache metrics (measured, never failing).

:func:`standard_checkers` composes them in the one place that decides the order.
"""

from __future__ import annotations

from conformance.harness.checker import Checker


def standard_checkers(families: tuple[str, ...] = ()) -> list[Checker]:
    """The checkers of one session, in order: coverage first (so counts
    include the step that fails), then the invariants of the schedule, the
    logits, the view against memory, the pool probe's verdict, and the
    retention families a check adds (``CheckSpec.observe``: ``"retention"``,
    ``"hit-rate"``, and ``"expected-hit"``, the
    expected-hit oracle of :mod:`conformance.judge.expected_hit`, which fails
    in the ``hit-rate`` family)."""
    from conformance.judge.coverage import CoverageCounter
    from conformance.judge.expected_hit import ExpectedHit
    from conformance.judge.hard_coverage import HardHistoryCoverage
    from conformance.judge.invariants import TablesReferenced, ViewMatchesMemory
    from conformance.judge.lifetime import PoolProbeServed
    from conformance.judge.logits import LogitsMatchReference
    from conformance.judge.memory_coverage import MemoryHistoryCoverage
    from conformance.judge.retention import RetentionChecker
    from conformance.judge.spec_decode import AcceptedPrefixOnly, SpecCoverage
    from conformance.judge.windows import WindowCoverage, WindowReadsHeld

    # (the window checkers do nothing for a model without window layers)
    return [CoverageCounter(), HardHistoryCoverage(), MemoryHistoryCoverage(), SpecCoverage(), WindowCoverage(),
            TablesReferenced(), WindowReadsHeld(), LogitsMatchReference(), ViewMatchesMemory(), AcceptedPrefixOnly(),
            PoolProbeServed(),
            *(ExpectedHit() if family == "expected-hit" else RetentionChecker(family) for family in families)]


def judged_session(impl_factory, impl_config, model, oracle, families: tuple[str, ...] = (),
                   timeout: float | None = 30.0, extra: tuple[Checker, ...] = ()):
    """A session judged by the standard checkers (plus the retention
    ``families`` and ``extra`` checkers): the way to drive an implementation
    by hand, operation by operation."""
    from conformance.harness.session import make_session

    return make_session(impl_factory, impl_config, model, oracle, [*standard_checkers(families), *extra],
                        timeout=timeout)
