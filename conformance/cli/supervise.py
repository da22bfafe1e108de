"""``hybrid-conformance run`` under supervision: the run executes in a child
process, and this (light) parent renders what it cannot: a run whose process
died.

Inside one process nothing can report an implementation that calls
``os._exit(0)``, a segfault in an engine's extension, or the kernel's OOM
killer: the process is gone, with its exit status (0 for ``os._exit(0)``).
The parent waits for the child and reads its results.json; a run that did
not finish (``finished`` null) is marked crashed, "the run's process died
(exit status N)" or "(killed by SIGKILL)", its planned checks not run, and
the exit status is 1, whatever the child's was.  A finished run's exit status
is the child's (0, 1, 2, 130, 143).  Cost: one more interpreter that imports
nothing heavy (about 0.1 s, docs/reports.md).

Signals: Ctrl-C reaches the whole foreground process group (the child stops
itself and exits 130); a SIGINT or SIGTERM sent to the parent alone (a CI's
cancel) is forwarded to the child.  The child stops at the first of them and
ignores the rest, so a signal delivered twice (to the group, and forwarded)
does not cut its reports short.

Only the ``run`` command of the console entry point (``hybrid-conformance``,
``python -m conformance``) is supervised; ``conformance.cli.main.main()``
called from Python runs in the caller's process (as the tests call it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Set in the child's environment: run unsupervised, and write the report directory's path to this file.
CHILD = "HCC_SUPERVISED_REPORT_DIR_FILE"


def wanted(argv: list[str]) -> bool:
    """Supervise this command line: ``run``, not already a supervised child, not turned off, not
    asking for help (``run --help`` prints and exits 0 with no report: no run to supervise)."""
    return bool(argv) and argv[0] == "run" and CHILD not in os.environ and \
        os.environ.get("HCC_NO_SUPERVISOR", "") in ("", "0") and not {"-h", "--help"} & set(argv[1:])


def tell_parent(report_dir: Path | None) -> None:
    """In a supervised child: say where the run writes its reports (once it is prepared)."""
    where = os.environ.get(CHILD)
    if where and report_dir is not None:
        Path(where).write_text(str(Path(report_dir).resolve()))


def first_signal_only() -> None:
    """In a supervised child: stop at the first SIGINT or SIGTERM and ignore
    the rest (Ctrl-C reaches it from the terminal and again from the parent)."""
    from conformance.cli.common import Terminated

    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    if os.environ.get(CHILD):
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)


def supervise(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="hcc-run-") as tmp:
        where = Path(tmp) / "report-dir"
        child = subprocess.Popen([sys.executable, "-m", "conformance", *argv], env={**os.environ, CHILD: str(where)})

        def forward(signum, frame):
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        status = child.wait()
        report_dir = Path(where.read_text()) if where.exists() else None
    if report_dir is None or not (report_dir / "results.json").exists():
        if status <= 0:  # a run always writes a report: it died before (0: os._exit(0)); the status says how
            print(f"hybrid-conformance: error: the run's process died ({_how(status)}) before it wrote a report",
                  file=sys.stderr)
            return 1
        return status  # a usage error (2) before any work, or an interruption before the first report
    return _judged(report_dir, status)


def _how(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _judged(report_dir: Path, status: int) -> int:
    """The child's exit status, unless its report shows the run never finished:
    then the report is completed (crashed: the process died) and the status is 1."""
    import json

    try:
        doc = json.loads((report_dir / "results.json").read_text())
    except (OSError, ValueError):
        return status if status > 0 else 1
    if doc.get("finished"):
        verdict = doc.get("verdict") or {}
        if status == 0 and verdict and not verdict.get("ok"):
            return 1  # the process said 0, its report says otherwise: the report wins
        return status if status >= 0 else 1
    from conformance.results.records import result_from_dict
    from conformance.results.report import ReportDir
    from conformance.results.verdict import judge_run
    from conformance.suite.options import now

    result = result_from_dict(doc)
    result.interrupted = True
    result.crashed = f"the run's process died ({_how(status)})"
    result.finished = now()
    result.verdict = None
    result.verdict = judge_run(result)
    with ReportDir(report_dir) as reports:  # its lock was the dead process's: taken over
        reports.write(result)
    print(f"hybrid-conformance: error: the run's process died ({_how(status)}): {len(result.checks)} checks "
          f"finished, {len(result.not_run)} did not run; the report in {report_dir} says so", file=sys.stderr)
    print(result.verdict.headline(), file=sys.stderr)
    return 1
