"""Driving an already-built implementation by hand, as the engine adapters' tests do
(a mutant there wraps an instance, not a class)."""

from conformance.harness.checker import CheckerSet
from conformance.harness.session import Session
from conformance.judge import standard_checkers


def session_of(impl, model, oracle) -> Session:
    """A session over ``impl`` judged by the standard checkers."""
    return Session(impl, model, oracle, CheckerSet(standard_checkers()))


def apply_all(session: Session, ops) -> None:
    """Apply ``ops``; every request must have finished."""
    for op in ops:
        session.apply(op)
    assert not session.active(), f"requests still active: {session.active()}"


def run_disagg(factory, model, oracle, scenario, pairing="2to1", transport="inprocess", faults=(), timeout=30.0):
    """A disaggregated session over ``factory`` (a ``DisaggImpl`` class or
    factory) at ``pairing``, judged by the disagg checkers, with ``scenario``'s
    disagg operations applied; the workers are closed whatever happens."""
    from conformance.contract import ImplConfig
    from conformance.harness.disagg import ops
    from conformance.judge.disagg import judged_disagg_session

    s = judged_disagg_session(factory, ImplConfig(options=ops.PAIRINGS[pairing]), model, oracle, transport,
                              tuple(faults), timeout=timeout)
    try:
        for op in scenario:
            s.apply(op)
    finally:
        s.close()
    return s
