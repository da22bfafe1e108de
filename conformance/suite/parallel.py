"""``--workers N``: the checks of one run in N processes on one machine.

Each worker is a fresh interpreter (multiprocessing "spawn": no forked torch
or Hypothesis state, and it behaves the same on Linux and macOS) that
prepares the same :class:`~conformance.suite.prepared.Run` from the same
options (the same plan, the same seeds), builds its own model and oracle
once, then runs whole checks by their position in the plan.  The parent
merges results as they arrive and writes reports after each, as the serial
loop does, so an interrupted parallel run keeps what finished."""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass, field, replace

_WORKER: dict = {}


def _init(options) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides what to
    # keep, so workers ignore SIGINT and are terminated by the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from conformance.suite.prepare import prepare_run
    from conformance.suite.prepared import resources_for

    run = prepare_run(options)
    _WORKER.update(run=run, res=resources_for(run))


def _run_one(position: int):
    from conformance.suite.execute import run_check

    run, res = _WORKER["run"], _WORKER["res"]
    check = run_check(run, run.checks[position], res)
    faults = res.faults.report() if res.faults is not None else {}
    return position, check, os.getpid(), res.oracle.reference_runs, faults


def worker_options(run):
    """The options a worker prepares the run from: the parent's, but nothing
    that does not pickle (the progress callback) and no report writing."""
    return replace(run.options, progress=None, write_reports=False, report_dir=None, workers=1)


@dataclass
class ParallelRun:
    workers: int
    # per worker pid: its latest cumulative counters (reports are cumulative per process)
    reference_runs: dict[int, int] = field(default_factory=dict)
    faults: dict[int, dict] = field(default_factory=dict)

    def metrics(self) -> dict:
        return {"workers": self.workers, "reference_runs": sum(self.reference_runs.values())}

    def merged_faults(self) -> dict:
        merged: dict[str, dict] = {}
        for report in self.faults.values():
            for name, info in report.items():
                into = merged.setdefault(name, {})
                for key, value in (info or {}).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        into[key] = into.get(key, 0) + value
                    else:
                        into.setdefault(key, value)
        return merged


def run_parallel(run, result, reports, notify) -> ParallelRun:
    n = min(run.workers, len(run.checks))
    state = ParallelRun(workers=n)
    done: dict[int, object] = {}
    ctx = multiprocessing.get_context("spawn")
    for planned in run.checks:
        notify("check-start", check=planned.id, index=planned.position, total=len(run.checks))
    with ctx.Pool(n, initializer=_init, initargs=(worker_options(run),)) as pool:
        # By position: the variants of one check share its index (its seed).
        # chunksize 1: checks differ a lot in cost, so hand them out one at a time
        for position, check, pid, refs, faults in pool.imap_unordered(_run_one, range(len(run.checks)),
                                                                       chunksize=1):
            done[position] = check
            state.reference_runs[pid] = refs
            if faults:
                state.faults[pid] = faults
            result.checks[:] = [done[i] for i in sorted(done)]  # keep the plan's order
            if state.faults:
                result.faults = state.merged_faults()
            if reports is not None:
                reports.check_finished(result, check)
            notify("check-end", check=check.id, result=check)
    return state
