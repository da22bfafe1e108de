"""One check against an implementation object (a class, not a ``--impl``
string): what :func:`conformance.testing.machine_test` runs.  The same
prepared run as ``hybrid-conformance run`` (the mutant, the options'
validation, the configuration variant's seed, coverage enforced, one
intra-op thread), so a green test means what a green run means."""

from __future__ import annotations

from dataclasses import replace

from conformance.results.records import CheckResult, RunResult
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


def execute_single_check(factory, check_id: str, opts: RunOptions) -> RunResult:
    """Run ``check_id`` as the one check of a run of ``factory``, through the
    CLI's own core (:func:`conformance.suite.run.execute`), and return that
    run's result with its verdict (``result.verdict``): each open defect's
    pinned repro is replayed first and the verdict is ``judge_run``'s, so
    ``machine_test`` reads FIXED, known and NEW where the CLI and the plugin
    do (not a copy of them: the same calls).  Nothing is written."""
    from conformance.suite.run import execute

    return execute(prepare_run(replace(opts, impl=factory, checks=(check_id,), matrix=False, write_reports=False,
                                       report_dir=None, shard=None, workers=1)))
