"""The ``disagg`` family: prefill on one worker, decode on another, a real
transfer between them (NIXL 1.5.1 over UCX, two processes, when ``nixl``
imports; else the in-process copy transport -- the result says which).

Hypothesis drives :class:`~conformance.generate.disagg_machine.DisaggMachine`
once per layout pairing (so both pairings run in every check, whatever the
draws): prompts whose transferred prefix ends on, beside or inside a block of
either worker, shared prefixes (prefill-side hits), decode continuing, single
steps with transfers in flight while other requests decode on reused pages,
aborts mid-transfer, and environment faults on the next transfer.  Every
example runs in a :class:`~conformance.harness.disagg.session.DisaggSession`
(every implementation call guarded with the run's ``--timeout``), is judged
by the checkers of :mod:`conformance.judge.disagg` and recorded as operations
(:mod:`conformance.harness.disagg.ops`) in the session's history.  A
failure is shrunk by Hypothesis (``shrink="hypothesis"``), then minimized by
replaying subsets of its operations (with ``shrink="ops"``, the mutants'
self-check, only the latter).

Workers (memories, transport, the NIXL peer process) are built once per
pairing and check, from a :class:`~conformance.harness.disagg.workers.WorkerPool`,
and reset to fresh poison for each example and each replay of a minimization:
an example replays on fresh workers exactly as it ran (``replay``).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure, FailureKind, ImplementationError, ReproFormatError, UsageError
from conformance.generate.disagg_machine import DisaggMachine, recorder_for_disagg
from conformance.generate.machine import hypothesis_settings
from conformance.harness.disagg import ops as dops
from conformance.harness.disagg.session import DisaggSession
from conformance.harness.disagg.workers import WorkerPool
from conformance.harness.ops import op_from_dict, op_to_dict
from conformance.harness.oracle import Oracle
from conformance.judge.disagg import judged_disagg_session
from conformance.results.records import CheckResult, Failure
from conformance.results.repro import operations_key
from conformance.suite.asked import engine_config
from conformance.suite.prepared import PlannedCheck, Resources, Run
from conformance.suite.seeds import check_seed
from conformance.suite.verdict import coverage_failure, run_machine


def disagg_factory_of(factory):
    """The implementation's disaggregated mode: a ``disagg_factory`` class
    attribute, or the factory itself when it plans for two workers."""
    inner = getattr(factory, "disagg_factory", None)
    if inner is not None:
        return inner
    if callable(getattr(factory, "disagg_layouts", None)):
        return factory
    return None


def transport_kind() -> str:
    import os

    return os.environ.get("HCC_DISAGG_TRANSPORT", "auto")  # auto | nixl | inprocess


def pairing_config(pairing: str, impl_options: dict) -> ImplConfig:
    return ImplConfig(options={**dops.PAIRINGS[pairing], **impl_options})


def replay_fails(dfactory, impl_config: ImplConfig, model, oracle, ops: list, kind: str = "auto",
                 pool: WorkerPool | None = None, timeout: float | None = 30.0):
    """Apply ``ops`` to a fresh session (on ``pool``'s workers, reset, or fresh
    ones); (failure or None, session)."""
    session = judged_disagg_session(dfactory, impl_config, model, oracle, kind, pool=pool, timeout=timeout)
    try:
        for op in ops:
            session.apply(op)
    except (ConformanceFailure, ImplementationError) as exc:
        return exc, session
    finally:
        session.close()
    return None, session


def examples_per_pairing(run: Run) -> int:
    """Hypothesis examples per layout pairing: half of ``--examples``, else a sixth
    of the profile's (each example runs two workers, transfers and byte audits).
    Not fewer than 4 by default: Hypothesis's first examples are its simplest one
    (which already reaches every required situation, see the machine's rules)
    and a few nearly empty ones that cost nothing; the random ones come after."""
    if run.examples_asked:
        return max(1, -(-run.examples_asked // len(dops.PAIRINGS)))
    return max(4, run.profile.examples // 6)


def run_disagg_check(run: Run, planned: PlannedCheck, res: Resources, notify=lambda *a, **k: None) -> CheckResult:
    spec = planned.spec
    model, oracle = res.model, res.oracle
    dfactory = disagg_factory_of(run.factory)
    if dfactory is None:
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           reason="the implementation has no disaggregated mode (no disagg_factory class "
                                  "attribute, no disagg_layouts())")
    per_pairing = examples_per_pairing(run)
    impl_options = dict(run.impl_options)
    kind = transport_kind()
    recorder = recorder_for_disagg(on_example=lambda r: notify("example", check=spec.id, examples=r.examples,
                                                                operations=r.steps,
                                                                of=per_pairing * len(dops.PAIRINGS)))
    started = time.perf_counter()
    pool = WorkerPool(model.config, kind)
    status, failure, config = "passed", None, None
    examples: int | None = 0
    started_with: dict = {}
    try:
        for i, pairing in enumerate(sorted(dops.PAIRINGS)):
            config = pairing_config(pairing, impl_options)
            started_with[pairing] = engine_config(dfactory, config, run.timeout)

            def machine(pairing=pairing):
                return DisaggMachine(dfactory, model=model, oracle=oracle, pairing=pairing,
                                     impl_options=impl_options, transport=kind, workers=pool, recorder=recorder,
                                     timeout=run.timeout)

            # A factory of machines: Hypothesis calls it as it would call the class.
            test = get_state_machine_test(machine, settings=hypothesis_settings(  # type: ignore[arg-type]
                per_pairing, run.hypothesis_steps, shrink=run.shrink == "hypothesis"))
            # one seed per check and pairing: the two pairings explore different draws
            test = hypothesis_seed(check_seed(run.seed, planned.seed_index, i, len(dops.PAIRINGS)))(test)
            outcome = run_machine(test, recorder)
            status, failure = outcome.status, outcome.failure
            examples = None if examples is None or outcome.examples is None else examples + outcome.examples
            if failure is not None:
                failure.impl_config = asdict(config)
                if failure.kind == FailureKind.TIMEOUT and failure.operations:
                    # a hang is not replayed (each replay would wait out the timeout again)
                    from conformance.suite.minimize import HANG_NOT_MINIMIZED

                    recorder.notes.add(HANG_NOT_MINIMIZED)
                elif failure.kind != FailureKind.HARNESS and run.shrink != "none" and failure.operations:
                    # "ops": instead of Hypothesis's shrinking; "hypothesis": after it, which
                    # leaves whole compound rules and idle steps behind (replays here are cheap:
                    # the pool's workers, no new peer process)
                    _minimize(failure, dfactory, config, model, oracle, kind, pool, run.timeout)
            if failure is not None:
                break
    finally:
        pool.close()
    if status == "passed":
        failure = coverage_failure(spec, recorder, examples)
        status = "failed" if failure is not None else status
    name = " + ".join(dict.fromkeys(n for n, _ in pool.transports)) or kind
    why = "; ".join(dict.fromkeys(w for _, w in pool.transports))
    return CheckResult(id=spec.id, family=spec.family, status=status,
                       description=f"{spec.description} [transport: {name}]",
                       examples=examples if examples is not None else recorder.examples,
                       test_cases=recorder.examples, operations=recorder.steps,
                       seconds=round(time.perf_counter() - started, 3), coverage=dict(recorder.coverage),
                       failure=failure, metrics={"transport": name, "transport_why": why,
                                                  "workers_built": pool.built, "peer_starts": pool.peer_starts},
                       notes=sorted(recorder.notes),
                       engine_config={p: c for p, c in started_with.items() if c})


def _minimize(failure: Failure, dfactory, config, model, oracle, kind, pool, timeout: float | None) -> None:
    """Shorten ``failure.operations`` by replaying subsets (same failure kind) on the pool's workers."""
    from conformance.suite.minimize import minimize

    def still_fails(candidate) -> bool:
        exc, _ = replay_fails(dfactory, config, model, oracle, candidate, kind, pool, timeout)
        return exc is not None and exc.kind == failure.kind

    ops = [op_from_dict(d) for d in failure.operations]
    if not still_fails(ops):
        return  # not reproducible by replay: keep it as it ran
    best = minimize(ops, still_fails, budget_s=60.0)
    exc, session = replay_fails(dfactory, config, model, oracle, best, kind, pool, timeout)
    failure.operations = [op_to_dict(o) for o in best]
    failure.message = str(exc)
    failure.events = session.history.tail()


def replay_disagg(repro, factory, model, outcome, timeout: float | None = 30.0, keep_events: bool = False):
    """Replay a disagg repro on fresh workers (transport as in a run: NIXL when it
    imports).  ``keep_events``: the whole history in ``outcome.events`` (else its tail)."""
    dfactory = disagg_factory_of(factory)
    if dfactory is None:
        raise UsageError(f"{outcome.impl} has no disaggregated mode; this repro needs one")
    key = operations_key(repro.version)
    if not all(dops.is_disagg(op) for op in repro.operations):
        raise ReproFormatError(f"{key}: disagg operations cannot mix with single-worker ones")
    session: DisaggSession | None = None
    try:
        session = judged_disagg_session(dfactory, repro.impl_config, model, Oracle(model), transport_kind(),
                                        timeout=timeout)
        outcome.notes.append(f"transport: {session.transport_name} ({session.transport_why})")
        for i, op in enumerate(repro.operations):
            try:
                session.apply(op)
            except ValueError as exc:  # the session refused the operation: the file is wrong, not the cache
                raise ReproFormatError(f"{key}[{i}]: {exc}") from None
            outcome.applied = i + 1
    except (ConformanceFailure, ImplementationError) as exc:
        outcome.reproduced = True
        outcome.kind = exc.kind
        outcome.message = str(exc)
        outcome.failed_at = outcome.applied if session is not None else None
    finally:
        if session is not None:
            session.close()
    if session is not None:
        outcome.events = session.history.as_data() if keep_events else session.history.tail()
        outcome.coverage = dict(session.coverage)
        outcome.notes += [f"fault {e.fault} fired on transfer "
                          f"{e.transfer.id if e.transfer is not None else None} "
                          f"({e.transfer.request_id if e.transfer is not None else None}): {e.what}"
                          for e in session.events]
    return outcome
