"""The one core behind the CLI, the pytest plugin and the Python API:
``execute(run)`` runs the checks of a prepared :class:`~conformance.suite.prepared.Run`
against one implementation and writes reports as it goes (an interrupted run
keeps what finished and lists what did not run); ``run(opts)`` prepares and
executes."""

from __future__ import annotations

from conformance.judge.metrics import merge_summaries
from conformance.results.records import CheckResult, RunResult
from conformance.results.report import ReportDir
from conformance.results.verdict import judge_run
from conformance.suite.execute import check_faults_exercised, run_check
from conformance.suite.known import as_dict, replay_pinned
from conformance.suite.options import RunOptions, now
from conformance.suite.prepare import prepare_run, select_shard
from conformance.suite.prepared import Resources, Run, resources_for

__all__ = ["RunOptions", "execute", "new_result", "run", "run_check", "select_shard"]


def run(opts: RunOptions) -> RunResult:
    """Prepare a run from ``opts`` and execute it."""
    return execute(prepare_run(opts))


def new_result(run: Run) -> RunResult:
    """The empty result of ``run``: what every front door fills.  Every
    planned check starts as not run (pending): a run killed before it reports
    it says so."""
    planned = run.planned_ids
    return RunResult(planned=planned, not_run=list(planned),
                     shard=f"{run.shard[0]}/{run.shard[1]}" if run.shard else "",
                     unsplit=list(run.unsplit) if run.shard else [],
                     implementation=run.name, implementation_version=run.version, seed=run.seed,
                     profile=run.profile.name, started=now(), model=run.model_config.to_dict(), mutant=run.mutant,
                     impl_spec=run.impl, fault_names=list(run.faults),
                     implementation_build=str(getattr(run.factory, "build", "") or ""),
                     impl_config={"options": dict(run.impl_options), "block_size": run.pools.block_size,
                                  "num_kv_blocks": run.pools.num_kv_blocks,
                                  "num_state_slots": run.pools.num_state_slots},
                     expectations=as_dict(run.expectations))


def execute(run: Run) -> RunResult:
    """Run ``run``'s plan and return its result with its verdict
    (``result.verdict``, :func:`conformance.results.verdict.judge_run`):
    judged once, here, and rendered by every door.  The reports are written
    before the first check (every planned check "not run: pending") and after
    each, so a run killed at any moment leaves an incomplete report."""
    result = new_result(run)
    reports = ReportDir(run.report_dir).open() if run.report_dir is not None else None
    notify = run.options.progress or (lambda *a, **k: None)
    res: Resources | None = None
    parallel = None
    if reports is not None:
        reports.write(result)
    try:
        if run.engine is not None:  # the engine level: whole engines run its checks (suite/engine_level.py)
            from conformance.suite.engine_level import execute_engine

            execute_engine(run, result, reports, notify)
        else:
            res = resources_for(run)
            parallel = _execute_checks(run, result, res, reports, notify)
    except BaseException as exc:  # a signal, or the harness itself raised outside any check
        result.interrupted = True
        if not isinstance(exc, KeyboardInterrupt):
            result.crashed = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        result.finished = now()
        if run.engine is None:
            result.metrics.update({"reference_runs": res.oracle.reference_runs if res is not None else 0,
                                   "cache": merge_summaries([c.metrics for c in result.checks if c.metrics])})
        if run.shard:
            result.metrics["shard"] = f"{run.shard[0]}/{run.shard[1]}"
        if parallel is not None:
            result.metrics.update(parallel.metrics())
        if res is not None and res.faults is not None and parallel is None:  # workers' were merged as they came
            result.faults = res.faults.report()
        if result.faults and not result.interrupted:
            check_faults_exercised(result)
        result.verdict = judge_run(result)
        if reports is not None:
            reports.finish(result)
            result.metrics["report_dir"] = str(reports.path)
    return result


def _execute_checks(run: Run, result: RunResult, res: Resources, reports: ReportDir | None, notify):
    """The cache-level checks: each open defect's pinned repro replayed, then
    the plan, serially or in ``--workers`` processes (returned: their record)."""
    if run.expectations is not None and run.expectations.table.open():
        # FIXED is decided by each open defect's pinned repro, replayed here on this implementation.
        notify("defect-replays", total=len(run.expectations.table.open()))
        result.defect_replays = replay_pinned(run.expectations, run.factory, res.model, res.oracle, run.timeout)
        notify("defect-replays-done", replays=result.defect_replays)
    if run.workers > 1 and len(run.checks) > 1:
        from conformance.suite.parallel import run_parallel

        return run_parallel(run, result, reports, notify)
    for planned in run.checks:
        notify("check-start", check=planned.id, index=planned.position, total=len(run.checks))
        check = run_check(run, planned, res, notify)
        record(result, check, reports)
        notify("check-end", check=planned.id, result=check)
        if run.stop_at_failure and check.status in ("failed", "error") \
                and not (check.failure is not None and check.failure.defect):  # a known defect: go on
            break
    return None


def record(result: RunResult, check: CheckResult, reports: ReportDir | None) -> None:
    """A finished check joins the result, and the reports are written: a run killed later keeps it."""
    result.add_check(check)
    if reports is not None:
        reports.check_finished(result, check)
