"""``--workers N``: the checks of one run in N processes on one machine.

Each worker is a fresh interpreter (multiprocessing "spawn": no forked torch
or Hypothesis state, and it behaves the same on Linux and macOS) that
prepares the same :class:`~conformance.suite.prepared.Run` from the same
options (the same plan, the same seeds), builds its own model and oracle
once, then runs whole checks by their position in the plan, handed to it one
at a time over a pipe.  The parent merges results as they arrive and writes
reports after each, as the serial loop does, so an interrupted parallel run
keeps what finished.

A worker that dies (killed by the OOM killer or a signal, an adapter calling
``os._exit``, a segfault) is noticed by its process sentinel, never waited
for: the check it was running is not run ("its worker process died (exit
status N)"), so the run's verdict is incomplete, and a fresh worker takes
the rest of the plan; after ``MAX_DEATHS`` deaths the run stops handing out
checks (what is left is not run, said).  A pool of the standard library
would wait for the dead worker's task for ever."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

_WORKER: dict = {}
MAX_DEATHS = 3  # workers that may die before the run stops handing out checks


def _init(options) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides what to
    # keep, so workers ignore SIGINT and are terminated by the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from conformance.suite.prepare import prepare_run
    from conformance.suite.prepared import freeze_heap, resources_for

    run = prepare_run(options)
    _WORKER.update(run=run, res=resources_for(run))
    freeze_heap()  # a worker ends with the run


def _run_one(position: int):
    from conformance.suite.execute import run_check

    run, res = _WORKER["run"], _WORKER["res"]
    check = run_check(run, run.checks[position], res)
    faults = res.faults.report() if res.faults is not None else {}
    return position, check, os.getpid(), res.oracle.reference_runs, faults


def _serve(options, conn) -> None:
    """A worker's loop: run the check at each position the parent sends, until None."""
    _init(options)
    while True:
        position = conn.recv()
        if position is None:
            return
        try:
            conn.send(("done", _run_one(position)))
        except Exception:  # noqa: BLE001 - the harness raised outside any check: the parent's run crashes
            conn.send(("crashed", traceback.format_exc()))
            return


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
    ctx = multiprocessing.get_context("spawn")
    for planned in run.checks:
        notify("check-start", check=planned.id, index=planned.position, total=len(run.checks))
    # By position: the variants of one check share its index (its seed); one at a time, since checks
    # differ a lot in cost.
    todo = deque(range(len(run.checks)))
    busy: dict = {}  # parent's end of the pipe -> (process, the position it runs)
    deaths = 0

    def hand_out(conn, proc) -> None:
        if todo:
            position = todo.popleft()
            conn.send(position)
            busy[conn] = (proc, position)
        else:
            conn.send(None)
            proc.join(timeout=30)

    def start() -> None:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(worker_options(run), there), daemon=True)
        proc.start()
        there.close()
        hand_out(here, proc)

    try:
        for _ in range(n):
            start()
        while busy:
            ready = wait(list(busy) + [proc.sentinel for proc, _ in busy.values()])
            for conn in [c for c in busy if c in ready or busy[c][0].sentinel in ready]:
                proc, position = busy.pop(conn)
                what, payload = _answer(conn)
                if what == "crashed":
                    raise RuntimeError(f"a worker's harness raised:\n{payload}")
                if what is None:  # no answer: the worker died with the check
                    proc.join(timeout=30)
                    deaths += 1
                    cid = run.checks[position].id
                    how = _how(proc.exitcode)
                    result.not_run_reasons[cid] = f"its worker process died ({how})"
                    notify("worker-died", check=cid, how=how)
                    if reports is not None:
                        reports.write(result)
                    if deaths < MAX_DEATHS:
                        if todo:
                            start()
                    else:
                        for k in todo:
                            result.not_run_reasons[run.checks[k].id] = \
                                f"the run stopped after {deaths} worker processes died"
                        todo.clear()
                    continue
                _, check, pid, refs, faults = payload
                state.reference_runs[pid] = refs
                if faults:
                    state.faults[pid] = faults
                result.add_check(check)  # in the plan's order
                if state.faults:
                    result.faults = state.merged_faults()
                if reports is not None:
                    reports.check_finished(result, check)
                notify("check-end", check=check.id, result=check)
                hand_out(conn, proc)
    finally:
        for proc, _ in busy.values():  # interrupted, or the harness raised: the workers go too
            proc.terminate()
        for proc, _ in busy.values():
            proc.join(timeout=30)
    return state


def _answer(conn) -> tuple[str | None, Any]:
    """A worker's answer, or (None, None) when it died without one."""
    try:
        return conn.recv() if conn.poll() else (None, None)
    except (EOFError, OSError):
        return None, None


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"
