"""Executing one check of a prepared run: its state machine under Hypothesis,
the verdict from what the checkers found and what the coverage reached, and
the failure minimized."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from conformance.contract import ImplConfig
from conformance.errors import FailureKind, ImplementationError
from conformance.generate.machine import HybridCacheMachine, Recorder, hypothesis_settings
from conformance.generate.spec import CheckSpec
from conformance.judge.metrics import CacheMetrics
from conformance.results.records import CheckResult, Failure, RunResult
from conformance.suite.asked import UNKNOWN, Hung, ask, declared_retention, engine_config, real_block_size
from conformance.suite.config_matrix import parse_variant_id
from conformance.suite.known import classifier_for, known_entry, minimize_known
from conformance.suite.options import ProgressFn
from conformance.suite.prepared import PlannedCheck, PoolSizes, Resources, Run
from conformance.suite.seeds import check_seed
from conformance.suite.verdict import coverage_failure, run_machine


def _quiet(event: str, **info: Any) -> None:
    pass


def check_impl_config(spec: CheckSpec, impl_options: Mapping[str, Any], pools: PoolSizes | None = None,
                      tier_option: tuple[str, Any] | None = None,
                      spec_option: tuple[str, Any] | None = None) -> ImplConfig:
    """The configuration a check builds the implementation with: the check's
    own, the run's pool sizes over it, the run's options over its options."""
    # A check's own setting of the tier option (a matrix variant choosing the
    # connector's mode) wins over the plain "on"; so does a variant's number
    # of speculative tokens over the implementation's own.
    tier = dict([tier_option]) if spec.tier and tier_option and tier_option[0] not in spec.options else {}
    drafts = dict([spec_option]) if spec.spec and spec_option and spec_option[0] not in spec.options else {}
    pools = pools or PoolSizes()
    return spec.impl_config(block_size=pools.block_size, num_kv_blocks=pools.num_kv_blocks,
                            num_state_slots=pools.num_state_slots,
                            options={**spec.options, **tier, **drafts, **impl_options})




def retention_note(configured: dict, declared) -> str | None:
    """A sentence when the implementation declares another retention policy
    than the check configured: it is then tested against its own declaration,
    and the result says so."""
    if not isinstance(declared, dict):
        return None
    differ = [k for k in ("interval", "admission") if k in configured
              and declared.get(k, "always" if k == "admission" else None) != configured[k]]
    if not differ:
        return None
    want = ", ".join(f"{k}={configured[k]!r}" for k in differ)
    got = ", ".join(f"{k}={declared.get(k)!r}" for k in differ)
    return f"the check configured {want}; the implementation declares {got} and was tested against its own declaration"


def run_check(run: Run, planned: PlannedCheck, res: Resources, notify: ProgressFn = _quiet) -> CheckResult:
    """Run one planned check of ``run`` with this process's resources.  The
    known defects of ``run.expectations`` are recorded and explored past, never
    raised (conformance.suite.known)."""
    spec = planned.spec
    if spec.disagg:
        from conformance.suite.disagg import run_disagg_check

        return run_disagg_check(run, planned, res, notify)
    factory, tier_option = run.factory, run.tier_option
    if spec.tier and not tier_option:
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           options=parse_variant_id(spec.id)[1],
                           reason="the implementation has no second tier (no tier_option class attribute)")
    spec_option = run.spec_option
    if spec.spec and not spec_option:
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           options=parse_variant_id(spec.id)[1],
                           reason="the implementation has no speculative decoding (no spec_option class attribute)")
    asked = check_impl_config(spec, run.impl_options, run.pools, tier_option, spec_option)
    if spec.observe and isinstance(factory, type) and not callable(getattr(factory, "retention", None)):
        return _no_retention(spec, asked)  # known without building it (its options may not be this check's)
    try:
        # One instance answers both questions when it keeps the block size asked
        # for (building an engine twice costs seconds); a hang ends the check here.
        built = ask("building the implementation", factory, asked, timeout=run.timeout)
    except Hung as hung:
        return _abandoned(spec, hung.error)
    except ImplementationError:
        built = None  # the check builds it again and reports the error, with context
    notes: list[str] = []
    declared = None if built is not None else UNKNOWN
    try:
        impl_config = real_block_size(factory, asked, run.timeout, built) if built is not None else asked
        started_with = engine_config(factory, impl_config, run.timeout, built if impl_config is asked else None) \
            if built is not None else {}
        if (spec.observe or spec.observe_when_declared or spec.tier) and built is not None:
            declared = declared_retention(factory, impl_config, run.timeout,
                                           built if impl_config is asked else None)
    except Hung as hung:
        return _abandoned(spec, hung.error)
    if spec.observe:
        note = retention_note(impl_config.options, declared)
        if note:
            notes.append(note)
    # The expected-hit oracle judges a second tier only in the unit the
    # implementation declares; without one, its counter of tier-decided
    # admissions stays at 0 and the coverage failure must say why.
    untiered = spec.tier and "expected-hit" in spec.observe and isinstance(declared, dict) \
        and not declared.get("tier_unit")
    why = ("the implementation declares no tier unit (retention()['tier_unit']): the expected-hit oracle "
           "cannot judge what it reuses from its second tier",) if untiered else ()
    notes.extend(why)
    # A host tier that never serves a longer prefix over a local hit (declared)
    # is correct, and the situation tier_hits_over_local counts never occurs
    # under it: not asked for, and the result says what went unchecked.
    conservative = spec.tier and isinstance(declared, dict) and declared.get("tier_over_local") is False
    waived: tuple[str, ...] = ("tier_hits_over_local",) if conservative else ()
    # A tier with no path for a lost load (declared: vLLM's offloading connector)
    # has its loads decided in time only (generate/rules/transfers.py): no host
    # entry is evicted under a load, and the result says what went undrawn.
    lossless = spec.tier and isinstance(declared, dict) and declared.get("tier_losses") is False
    if lossless:
        waived += ("store_evicted_during_load",)
        notes.append("the implementation declares tier_losses=False (its tier has no path for a lost load): "
                     "loads were decided in time only (late, out of order), none failed, short or evicted under "
                     "the load; --faults injects those against its recorded limitation")
    if spec.observe_when_declared and declared is None:
        notes.append(f"the implementation declares no retention policy: {', '.join(spec.observe_when_declared)} "
                     f"did not judge this check")
    if spec.observe and declared is None:
        return _no_retention(spec, impl_config)
    recorder = Recorder(on_example=lambda r: notify("example", check=spec.id, examples=r.examples,
                                                    operations=r.steps, of=run.examples))
    cache_metrics = CacheMetrics()
    env = res.faults

    def attach(session):
        session.add_checker(cache_metrics)
        if env is not None:
            env.attach(session)

    known, facts = classifier_for(run.expectations, factory, impl_config)

    def machine():
        return HybridCacheMachine(factory, spec, model=res.model, oracle=res.oracle, impl_config=impl_config,
                                  timeout=run.timeout, recorder=recorder, attach=attach, known=known)

    # A factory of machines: Hypothesis calls it as it would call the class.
    test = get_state_machine_test(machine, settings=hypothesis_settings(  # type: ignore[arg-type]
        run.examples, run.hypothesis_steps, shrink=run.shrink in ("hypothesis", "hypothesis+ops")))
    test = hypothesis_seed(check_seed(run.seed, planned.seed_index))(test)
    started = time.perf_counter()
    outcome = run_machine(test, recorder)
    status, failure = outcome.status, outcome.failure
    # A hang is not replayed: each replay would wait out the timeout again
    # (the repro keeps the example's operations as they ran).
    if failure is not None and failure.kind not in (FailureKind.HARNESS, FailureKind.TIMEOUT,
                                                    FailureKind.NONDETERMINISTIC) \
            and run.shrink in ("ops", "hypothesis+ops") and failure.operations:
        minimize_failure(failure, factory, spec, impl_config, res, run.timeout, known)
    if failure is not None and failure.kind == FailureKind.TIMEOUT and failure.operations:
        from conformance.suite.minimize import HANG_NOT_MINIMIZED

        notes.append(HANG_NOT_MINIMIZED)
    met = known_defects_met(recorder, factory, spec, impl_config, res, run, known)
    if status == "passed":
        failure = coverage_failure(spec, recorder, outcome.examples, why, faulted=env is not None,
                                   waived=waived)
        status = "failed" if failure is not None else status
    if conservative and "tier_hits_over_local" in spec.required:
        over = recorder.coverage.get("tier_hits_over_local", 0)
        notes.append("the implementation declares tier_over_local=False: a host-tier hit over a local one was "
                     "not asked for, and its reconciliation was not checked" if not over else
                     f"the implementation declares tier_over_local=False, yet {over} hits read host-tier loads "
                     f"past a local hit (memory's load ids): the declaration does not hold")
    if status == "passed" and met:
        # Only known defects: the check fails with the first, which triage names.
        first = met[0]
        failure = Failure(kind=first["kind"], message=first["message"], operations=first["operations"],
                          events=first["events"], examples_to_failure=first["first_example"],
                          seconds_to_failure=first["seconds_to_first"], defect=first["defect"])
        status = "failed"
    if failure is not None:
        failure.impl_config = asdict(impl_config)
    return CheckResult(id=spec.id, family=spec.family, status=status, description=spec.description,
                       options=parse_variant_id(spec.id)[1],
                       examples=outcome.examples if outcome.examples is not None else recorder.examples,
                       test_cases=recorder.examples, operations=recorder.steps,
                       seconds=round(time.perf_counter() - started, 3), coverage=dict(recorder.coverage),
                       failure=failure, metrics=cache_metrics.summary(), notes=notes + sorted(recorder.notes),
                       engine_config=started_with, facts=facts, known_defects=met)


def known_defects_met(recorder: Recorder, factory, spec: CheckSpec, impl_config, res: Resources, run: Run,
                      known=None) -> list[dict]:
    """The known defects the check's exploration met, each minimized (by
    replay, to that same defect) when failures are minimized."""
    out = []
    for met in recorder.known.values():
        operations, message, events = met.ops, met.message, met.events
        if run.shrink in ("ops", "hypothesis+ops") and res.faults is None and known is not None:
            operations, message, events = minimize_known(met, factory, impl_config, res.model, res.oracle,
                                                         spec.observe, known, run.timeout)
        out.append(known_entry(met, operations, message, events))
    return out


def _no_retention(spec: CheckSpec, impl_config) -> CheckResult:
    return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                       options=parse_variant_id(spec.id)[1],
                       reason=f"the implementation declares no retention policy (optional retention() "
                              f"method) for the options {impl_config.options}")


def _abandoned(spec: CheckSpec, error: ImplementationError) -> CheckResult:
    """The check's result when the implementation hung before its first example."""
    return CheckResult(id=spec.id, family=spec.family, status="error", description=spec.description,
                       options=parse_variant_id(spec.id)[1], failure=Failure(kind=error.kind, message=str(error)))


def minimize_failure(failure: Failure, factory, spec: CheckSpec, impl_config, res: Resources,
                     timeout: float | None, known=None) -> None:
    """Shorten ``failure.operations`` by replaying subsets (same failure kind, and
    never a known defect: a NEW failure must not slip into a known one), in place."""
    from conformance.harness.ops import op_from_dict, op_to_dict
    from conformance.suite.minimize import minimize, replay_fails

    env = res.faults

    def outcome(ops):
        return replay_fails(factory, impl_config, res.model, res.oracle, ops,
                            env.attach if env is not None else None, timeout=timeout, families=spec.observers)

    def still_fails(ops) -> bool:
        exc, _ = outcome(ops)
        return exc is not None and exc.kind == failure.kind and (known is None or known(exc) is None)

    ops = [op_from_dict(d) for d in failure.operations]
    if not still_fails(ops):
        return  # not reproducible by replay (it depended on state across examples): keep it as it is
    best = minimize(ops, still_fails)
    exc, session = outcome(best)
    failure.operations = [op_to_dict(op) for op in best]
    failure.message = str(exc)
    failure.events = session.history.tail()


FAULTS_EXERCISED = "faults-exercised"


def check_faults_exercised(result: RunResult) -> None:
    """A fault that never fired proves nothing, nor one whose effect nothing
    consumed (a corrupted offload never loaded, a corrupted load never read
    nor rejected): the run fails, as a check of its own.  When every fault
    fired and was consumed, the check passes and says so per fault: a green
    ``--faults`` run shows that its faults were there."""
    silent, unconsumed = [], []
    for name, info in result.faults.items():
        # recomputed: workers' reports are merged by summing
        info["exercised"] = bool(info.get("consumed"))
        if not info.get("fired"):
            silent.append(name)
        elif not info["exercised"]:
            unconsumed.append(name)
    description = "every injected environment fault fired and its effect was consumed"
    if not silent and not unconsumed:
        notes = [f"{n} fired {info.get('fired')} times and was consumed {info.get('consumed')} times"
                 for n, info in result.faults.items()]
        result.checks.append(CheckResult(id=FAULTS_EXERCISED, family="fault-injection", status="passed",
                                         description=description, notes=notes))
        return
    parts = []
    if silent:
        hint = result.faults[silent[0]].get("hint", "")
        parts.append(f"faults never fired: {', '.join(silent)}" + (f" ({hint})" if hint else ""))
    if unconsumed:
        parts.append("faults fired but their effect was never consumed (no faulty load was read or rejected "
                     "by a computed step, no failed offload reported): "
                     + ", ".join(f"{n} (fired {result.faults[n]['fired']} times)" for n in unconsumed))
    result.checks.append(CheckResult(id=FAULTS_EXERCISED, family="fault-injection", status="failed",
                                     description=description,
                                     failure=Failure(kind=FailureKind.COVERAGE, message="; ".join(parts))))
