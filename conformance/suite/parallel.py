"""``--workers N``: the checks of one run in N processes on one machine.

Each worker is a fresh interpreter (multiprocessing "spawn": no forked torch
or Hypothesis state, and it behaves the same on Linux and macOS) that builds
its own implementation factory, model and oracle once, then runs whole checks.
The parent merges results as they arrive and writes reports after each, as the
serial loop does, so an interrupted parallel run keeps what finished."""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass, field, replace

_WORKER: dict = {}


def _init(opts) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides what to
    # keep, so workers ignore SIGINT and are terminated by the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)  # as run() does: N workers on N cores, no intra-op threads fighting them
    from conformance.harness.oracle import Oracle
    from conformance.model import TinyHybrid
    from conformance.suite.known import expectations_for
    from conformance.suite.prepare import prepare

    factory, _name, _specs, model_config, env = prepare(opts)
    model = TinyHybrid(model_config)
    expectations = expectations_for(opts.impl, str(getattr(factory, "version", "unknown")), opts.expectations)
    _WORKER.update(opts=opts, factory=factory, model=model, oracle=Oracle(model), env=env, expectations=expectations)


def _run_one(job: tuple[int, int, str]):
    from conformance.suite.checks import PROFILES, get_check
    from conformance.suite.execute import run_check

    position, index, check_id = job
    w = _WORKER
    opts = w["opts"]
    res = run_check(w["factory"], get_check(check_id), w["model"], w["oracle"], opts, PROFILES[opts.profile],
                    index, w["env"], expectations=w["expectations"])
    faults = w["env"].report() if w["env"] is not None else {}
    return position, res, os.getpid(), w["oracle"].reference_runs, faults


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


def run_parallel(opts, planned: list, result, out, notify) -> ParallelRun:
    from conformance.suite.execute import record_check

    n = min(opts.workers, len(planned))
    state = ParallelRun(workers=n)
    # What a worker needs must pickle: no progress callback, no report writing there.
    wopts = replace(opts, progress=None, write_reports=False, report_dir=None, workers=1, shard=None)
    done: dict[int, object] = {}
    ctx = multiprocessing.get_context("spawn")
    for k, (_, spec) in enumerate(planned):
        notify("check-start", check=spec.id, index=k, total=len(planned))
    with ctx.Pool(n, initializer=_init, initargs=(wopts,)) as pool:
        # By position: the variants of one check share its index (its seed).
        jobs = [(k, index, spec.id) for k, (index, spec) in enumerate(planned)]
        # chunksize 1: checks differ a lot in cost, so hand them out one at a time
        for position, res, pid, refs, faults in pool.imap_unordered(_run_one, jobs, chunksize=1):
            done[position] = res
            state.reference_runs[pid] = refs
            if faults:
                state.faults[pid] = faults
            result.checks[:] = [done[i] for i in sorted(done)]  # keep the profile's order
            if state.faults:
                result.faults = state.merged_faults()
            record_check(out, result, res)
            notify("check-end", check=res.id, result=res)
    return state
