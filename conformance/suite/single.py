"""One check against an implementation object (a class, not a ``--impl``
string): what :func:`conformance.testing.machine_test` runs.  The same
prepared run as ``hybrid-conformance run`` (the mutant, the options'
validation, the configuration variant's seed, coverage enforced, one
intra-op thread), so a green test means what a green run means."""

from __future__ import annotations

from dataclasses import replace

from conformance.results.records import CheckResult, CheckVerdict
from conformance.suite.execute import run_check
from conformance.suite.options import RunOptions
from conformance.suite.prepare import prepare_run
from conformance.suite.prepared import Resources, resources_for


def run_single_check(factory, check_id: str, opts: RunOptions, resources: Resources | None = None) -> CheckResult:
    """Run ``check_id`` (a check or a variant id) of ``opts``'s profile against
    ``factory``, exactly as the CLI runs it; nothing is written."""
    run = prepare_run(replace(opts, impl=factory, checks=(check_id,), matrix=False, write_reports=False,
                              report_dir=None, shard=None, workers=1))
    return run_check(run, run.checks[0], resources or resources_for(run))


def judge_single_check(factory, check_id: str, opts: RunOptions,
                       resources: Resources | None = None) -> tuple[CheckResult, CheckVerdict]:
    """Run ``check_id`` as :func:`run_single_check` does, and its verdict as
    the run's verdict judges it (``conformance.results.verdict``): against the
    implementation's expectations file (known defects, expected failures), so
    that ``machine_test`` renders what the CLI and the plugin render."""
    from conformance.results.verdict import judge_run
    from conformance.suite.options import now
    from conformance.suite.run import new_result

    run = prepare_run(replace(opts, impl=factory, checks=(check_id,), matrix=False, write_reports=False,
                              report_dir=None, shard=None, workers=1))
    res = run_check(run, run.checks[0], resources or resources_for(run))
    result = new_result(run)
    result.add_check(res)
    result.finished = now()
    verdict = judge_run(result).check(res.id)
    assert verdict is not None
    return res, verdict
