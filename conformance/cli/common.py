"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from conformance.suite.options import parse_options, timeout_problem

__all__ = ["parse_options"]  # re-exported: the subcommands import it from here


def engine_check_ids() -> set[str]:
    """Every engine-level check id any engine profile plans (conformance.suite.engine_level)."""
    from conformance.suite.engine_level import engine_check_ids as ids

    return ids()


def load_expectations_for_cli(path):
    """An expectations file named on the command line, validated with every
    check id known (usage error, exit 2, for any bad entry)."""
    from conformance.suite.known import load_for_run

    return load_for_run(path, engine_check_ids())


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def call_timeout(text: str) -> float:
    """An argparse type: an implementation call's timeout in seconds, a finite
    number above 0 and at most a day (``suite.options.timeout_problem``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    why = timeout_problem(value)
    if why:
        raise argparse.ArgumentTypeError(f"{text} {why}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (a size, a price)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 0")
    return value


def path_arg(text: str) -> Path:
    """An argparse type: a path that names something.  ``Path("")`` is the
    current directory: an empty argument (an unset variable in a CI script)
    would silently write or read there."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names nothing (for the current directory, say '.')")
    return Path(text)


def add_impl_options(p) -> None:
    p.add_argument("--impl", default="reference", help="reference, vllm or module:Class (default: reference)")
    p.add_argument("--seed", type=int, default=0, help="one seed reproduces the whole run (default 0)")
    p.add_argument("--report-dir", type=path_arg, default=None,
                   help="where to write reports (default reports/<run-id>/)")
    p.add_argument("--timeout", type=call_timeout, default=30.0,
                   help="seconds an implementation call may take (default 30)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="implementation option, e.g. interval=8 (JSON values; repeatable)")
    p.add_argument("--block-size", type=positive_int, default=None, help="override the checks' block size")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="override the checks' KV pool size (ImplConfig.num_kv_blocks; at least 2)")
    p.add_argument("--state-slots", type=int, default=None, metavar="N",
                   help="override the checks' state-slot pool size (ImplConfig.num_state_slots; at least 2)")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI cancel): stops the run as Ctrl-C does; the exit code is 143 (128 + SIGTERM)."""


def terminated(signum, frame):
    raise Terminated


class Progress:
    """One line per check, rewritten in place on a terminal."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # looked up now: sys.stderr may be replaced (pytest capture)
        self.tty = self.stream.isatty()
        self.said: dict[str, str] = {}  # failure message -> the first check that printed it

    def __call__(self, event: str, **info) -> None:
        if event == "check-start":
            self._line(f"[{info['index'] + 1}/{info['total']}] {info['check']} ...")
        elif event == "example" and self.tty:
            self._line(f"    {info['check']}: {info['examples']} test cases, {info['operations']} operations",
                       end="\r")
        elif event == "check-end":
            r = info["result"]
            cov = ", ".join(f"{k}={v}" for k, v in r.coverage.items() if v)
            self._line(f"    {r.id}: {r.status.upper()} ({r.examples} examples, {r.operations} operations, "
                       f"{r.seconds:.1f}s) {cov}")
            for note in r.notes:
                self._line(f"      note: {note}")
            if r.metrics.get("transport"):  # the disagg family says which transport carried the bytes
                self._line(f"      transport: {r.metrics['transport']} ({r.metrics.get('transport_why', '')})")
            if r.status == "skipped":
                self._line(f"      skipped: {r.reason or 'no reason given'}")
            if r.failure is not None:
                known = f"known defect {r.failure.defect}: " if r.failure.defect else ""
                first = self.said.setdefault(r.failure.message, r.id)
                if first != r.id:  # a constructor that raises says so once, not once per check
                    head = r.failure.message.splitlines()[0][:160]
                    self._line(f"      {known}{r.failure.kind}: the same failure as {first} ({head})")
                else:
                    self._line(f"      {known}{r.failure.kind}: {r.failure.message[:300]}")
                if r.failure.repro:
                    self._line(f"      repro: {r.failure.repro} ({len(r.failure.operations)} operations)")
            for met in r.known_defects:
                if r.failure is None or met["defect"] != r.failure.defect:
                    self._line(f"      known defect {met['defect']} met in {met['count']} example(s), explored past")
        elif event == "worker-died":  # --workers: the process running a check died (suite/parallel.py)
            self._line(f"    {info['check']}: NOT RUN: its worker process died ({info['how']})")
        elif event == "engine":  # an engine-level run's own progress line
            self._line(f"  {info['message']}")
        elif event == "defect-replays":
            self._line(f"replaying the pinned repros of {info['total']} open known defect(s) ...")
        elif event == "defect-replays-done":
            for rec in info["replays"]:
                outcome = rec["outcome"] if rec["outcome"] == "reproduces" else rec["outcome"].upper()
                why = f" ({rec.get('kind')}: {(rec.get('message') or '')[:160]})" if rec["outcome"] == "changed" else ""
                self._line(f"    {rec['defect']}: {outcome}{why}")

    def _line(self, text: str, end: str = "\n") -> None:
        if self.tty:
            text = "\x1b[2K" + text
        print(text, end=end, file=self.stream, flush=True)


def summary_lines(result) -> list[str]:
    """The end-of-run summary: counts (skipped included), each skipped check
    with its reason, and a loud line when nothing was checked."""
    summary = result.to_dict()["summary"]
    perf = (f" ({summary['hit_rate_failures']} of them hit-rate: reuse below the declared policy, logits right)"
            if summary.get("hit_rate_failures") else "")
    lines = [f"{result.implementation} {result.implementation_version}: {summary['passed']} passed, "
             f"{summary['failed']} failed{perf}, {summary['error']} errors, {summary['skipped']} skipped; reports in "
             f"{result.metrics.get('report_dir')}"]
    lines += [f"  skipped {c.id}: {c.reason or 'no reason given'}" for c in result.checks if c.status == "skipped"]
    if not result.checked and not result.interrupted:
        lines.append("nothing was checked: every check was skipped (or none ran); this run proves nothing (exit 1)")
    elif result.checked:
        from conformance.results.compare import what_ran

        why = what_ran(result.to_dict())
        if why:  # every check errored building the implementation: one line says it
            lines.append(f"nothing was checked: {why}")
    if result.interrupted and result.not_run:
        why = f"the run crashed ({result.crashed})" if result.crashed else "interrupted"
        lines.append(f"{why}: {len(result.not_run)} planned checks did not run ({', '.join(result.not_run)})")
    return lines
