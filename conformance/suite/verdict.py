"""A check's verdict from its state machine's run: what one Hypothesis run
ended with (a finding of the implementation, a crash of the harness, or
nothing), and whether the check's situation occurred at all.  Shared by the
single-worker checks (``suite/execute.py``) and the disagg family
(``suite/disagg.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis.errors import Flaky
from hypothesis.statistics import collector

from conformance.errors import Abandoned, ConformanceFailure, FailureKind, ImplementationError, UsageError
from conformance.generate.machine import Recorder, stable_draws
from conformance.generate.spec import CheckSpec
from conformance.results.records import Failure


@dataclass
class MachineOutcome:
    """How one Hypothesis run of a check's machine ended."""

    status: str  # passed | failed | error
    failure: Failure | None
    # Examples as ``--examples`` counts them (Hypothesis's valid examples, the
    # failing one included; not the invalid ones, not shrinking's): what the
    # run reports.  None when this Hypothesis reports no statistics.
    examples: int | None


def run_machine(test: Callable[[], None], recorder: Recorder) -> MachineOutcome:
    """Run a machine test.  A crash of the harness is an error naming it, never a pass."""
    stats: list[dict] = []
    try:
        # Hypothesis reports each run's statistics to this collector (what its pytest plugin prints);
        # its type says None because that is its default value.
        with stable_draws(), collector.with_value(stats.append):  # type: ignore[arg-type]
            try:
                test()
            except Abandoned as abandoned:  # a hang: no example replayed, the implementation not called again
                raise abandoned.error from None
    except (ConformanceFailure, ImplementationError) as exc:
        status = "error" if isinstance(exc, ImplementationError) else "failed"
        steps, events = (recorder.failure[1], recorder.failure[2]) if recorder.failure else ([], [])
        first = recorder.first_failure or (None, None)
        examples = examples_of(stats)
        return MachineOutcome(status, Failure(kind=exc.kind, message=str(exc), operations=steps, events=events[-12:],
                                              examples_to_failure=examples if examples is not None else first[0],
                                              test_cases_to_failure=first[0], seconds_to_failure=first[1]),
                              examples)
    except UsageError:
        raise
    except Flaky as exc:  # the implementation failed, then did not fail on the same draws: it is not deterministic
        return MachineOutcome("failed", nondeterministic(exc, recorder, examples_of(stats)), examples_of(stats))
    except Exception as exc:  # noqa: BLE001 - a harness-side crash is reported, never a pass
        return MachineOutcome("error", Failure(kind=FailureKind.HARNESS, message=f"{type(exc).__name__}: {exc}",
                                               operations=recorder.failure[1] if recorder.failure else []),
                              examples_of(stats))
    return MachineOutcome("passed", None, examples_of(stats))


# The note a nondeterministic failure's message ends with, after its first failure: ``first_failure``
# splits the message there (the first failure's own message may span lines).
NOT_AGAIN = ("replaying the same operations did not fail again: the implementation does not repeat itself "
             "(iteration over a set of objects hashed by address, a clock, a random draw, state kept across "
             "instances...); the repro below is the first failure as it happened")


def nondeterministic(flaky: Exception, recorder: Recorder, examples: int | None) -> Failure:
    """The failure of an implementation that does not repeat itself: the first
    failure Hypothesis met (its message, operations and events, as recorded
    when it happened), of kind ``nondeterministic``, with a note that its
    replay did not fail again.  The implementation's problem, never the
    harness's: a cache whose decisions depend on addresses, clocks or chance
    cannot be tested by replay, nor can its users reproduce what it does."""
    first = next((e for e in getattr(flaky, "exceptions", ()) if isinstance(e, (ConformanceFailure,
                                                                                  ImplementationError))), None)
    recorded = recorder.failure
    if first is None and recorded is not None:
        first = recorded[0]
    steps, events = (recorded[1], recorded[2]) if recorded else ([], [])
    if first is not None:
        what = f"{getattr(first, 'kind', type(first).__name__)}: {first}"
    else:  # the draws themselves changed on replay: the implementation steered them otherwise
        what = f"the same draws led elsewhere when replayed ({type(flaky).__name__}: {str(flaky).splitlines()[0]})"
    note = NOT_AGAIN
    done = recorder.first_failure or (None, None)
    return Failure(kind=FailureKind.NONDETERMINISTIC, message=f"nondeterministic: {what}\n{note}", operations=steps,
                   events=events[-12:], examples_to_failure=examples if examples is not None else done[0],
                   test_cases_to_failure=done[0], seconds_to_failure=done[1])


def first_failure(message: str) -> tuple[str, str] | None:
    """The first failure a ``nondeterministic`` failure's message records
    (what :func:`nondeterministic` wrote): its kind and message, or None when
    it records none (the draws themselves changed on replay).  ``replay``
    reads it to tell whether a replay met that failure again."""
    what = message.removeprefix(f"{FailureKind.NONDETERMINISTIC.value}: ").split(f"\n{NOT_AGAIN}")[0]
    kind, _, rest = what.partition(": ")
    if kind not in {k.value for k in FailureKind}:
        return None
    return kind, rest


# The phases whose test cases Hypothesis counts towards max_examples (not shrinking, not explaining).
_COUNTED_PHASES = ("explicit-phase", "reuse-phase", "generate-phase", "target-phase")


def examples_of(stats: list[dict]) -> int | None:
    """The examples Hypothesis ran as ``max_examples`` counts them (valid
    ones and the failing one), from the statistics it reports per run."""
    if not stats:
        return None
    total = 0
    for run in stats:
        for phase in _COUNTED_PHASES:
            cases = (run.get(phase) or {}).get("test-cases") or []
            total += sum(1 for c in cases if c.get("status") in ("valid", "interesting"))
    return total


# Counters whose situation needs a transfer to arrive intact, each with the
# counter of the same situation where a load came back broken.  Environment
# faults break transfers by chance (``transfer-fail`` at p=1 breaks every
# one): a run under them is asked for the situation, intact or broken, never
# for what only an intact wire can give, and the result says which it got.
BROKEN_BY_FAULTS = {
    # an admission only the host tier could serve (expected-hit oracle): judged,
    # or excused because a load of the request broke and it recomputed
    "remote_expected": "remote_excused",
    # a prefix hit served by a tier load, or a request that went on after its load broke
    "tier_hits": "tier_recoveries",
    # the same, where the loaded hit is longer than the local one (memory_coverage):
    # a load broken on its way has no length to compare, so the recovery stands for it too
    "tier_hits_over_local": "tier_recoveries",
}


def coverage_failure(spec: CheckSpec, recorder: Recorder, examples: int | None = None,
                     why: tuple[str, ...] = (), faulted: bool = False,
                     waived: tuple[str, ...] = ()) -> Failure | None:
    """A check whose situation never occurred proves nothing: it fails.
    ``why``: what the run already knows of the cause (said after the counters).
    ``faulted``: the run injected environment faults (``BROKEN_BY_FAULTS``;
    a counter met only by its broken counterpart is noted in the result).
    ``waived``: counters the implementation's declared policy rules out (the
    caller notes why; they are not asked for)."""
    cov = recorder.coverage
    missing = []
    for c in spec.required:
        if cov.get(c, 0) or c in waived:
            continue
        broken = BROKEN_BY_FAULTS.get(c) if faulted else None
        if broken is not None and cov.get(broken, 0):
            recorder.notes.add(f"under environment faults {c} stayed at 0: every such situation had a transfer "
                               f"the faults broke ({broken}={cov[broken]}); the recovery was judged, the reuse of "
                               f"intact transfers was not")
            continue
        missing.append(c)
    if not missing:
        return None
    because = "".join(f"; {w}" for w in why)
    n = examples if examples is not None else recorder.examples
    return Failure(kind=FailureKind.COVERAGE, message=f"the {spec.family} situation never occurred: "
                                                      f"{', '.join(missing)} stayed at 0 over {n} examples{because}")
