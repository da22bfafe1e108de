"""How Hypothesis runs the machines: the settings of one check, and the one
patch of Hypothesis's internals the suite needs (so that one seed gives the
same examples in every process)."""

from __future__ import annotations

from contextlib import contextmanager

from hypothesis import HealthCheck, Phase, settings


@contextmanager
def stable_draws():
    """Make one seed give the same examples in every process.

    Hypothesis (6.13x and later) mixes constants collected from whatever local
    modules happen to be imported into its draws, so the CLI, a --workers
    process and a pytest session would explore differently from one seed.
    While our checks run, it draws from no local constants at all."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # an older Hypothesis without the mechanism
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    if original is None:
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original


def hypothesis_settings(examples: int, steps: int, database=None, shrink: bool = True) -> settings:
    # shrink=False: the caller minimizes the failing operations itself (conformance.suite.minimize)
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p is not Phase.shrink)
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=database, phases=phases,
                    derandomize=False, report_multiple_bugs=False, print_blob=False,
                    suppress_health_check=list(HealthCheck))
