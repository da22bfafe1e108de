"""``hybrid-conformance matrix RESULTS...``: several runs side by side, by
check family (the reference, vLLM at both levels, SGLang: each run in its own
environment, each a results.json or a report directory).

Exit 1 when a row is not green (a failure or an error, an interrupted run, a
run that checked nothing), unless the expectations file of that row's engine
and version (``fixtures/expectations/``, as ``run`` finds it) judges the row
as expected: a matrix is a verdict too, never green over a failing row."""

from __future__ import annotations

from pathlib import Path

from conformance.cli.common import path_arg
from conformance.errors import CompareInputError, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("matrix", help="several runs side by side, one row per run, one column per family")
    p.add_argument("results", type=path_arg, nargs="+", help="results.json files or report directories")
    p.add_argument("--html", type=path_arg, default=None, metavar="FILE", help="also write the matrix as HTML")
    p.set_defaults(func=main)


def row_verdict(row: dict, directory: Path | None = None) -> tuple[bool, str]:
    """(green, why) for one row: green when it passed, or when its expectations
    file (in ``directory``, default ``fixtures/expectations/``) says it is as expected."""
    from conformance.results.compare import find_expectations, format_expectations, what_ran
    from conformance.results.expectations import EXPECTATIONS_DIR
    from conformance.results.matrix import run_label

    label = run_label(row)
    checks = row.get("checks") or []
    bad = [c["id"] for c in checks if c.get("status") in ("failed", "error")]
    nothing = what_ran(row)
    if row.get("interrupted"):
        how = f"crashed ({row['crashed']})" if row.get("crashed") else "interrupted"
        return False, f"{label}: {how} (its results are incomplete)"
    impl = row.get("impl_spec") or row.get("implementation") or ""
    expectations = None if row.get("mutant") else find_expectations(impl, row.get("implementation_version") or "",
                                                                     directory or EXPECTATIONS_DIR,
                                                                     build=row.get("implementation_build") or "")
    # The run's verdict, judged as `run` judges it (conformance.results.verdict): a run killed, still running,
    # or with planned checks that never ran is incomplete, never green, whatever its checks say.
    from conformance.results.verdict import judge_run

    verdict = judge_run({**row, "expectations": {"path": str(expectations)} if expectations else None})
    if verdict.incomplete and not nothing:
        return False, f"{label}: incomplete ({'; '.join(verdict.incomplete)})"
    if not bad and not nothing:
        return True, f"{label}: passed"
    if expectations is not None and not nothing:
        _, as_expected = format_expectations(row, expectations)
        if as_expected:
            return True, f"{label}: {len(bad)} failing checks, as expected by {expectations}"
        return False, f"{label}: not as expected by {expectations} (hybrid-conformance compare {expectations} ...)"
    if nothing:
        return False, f"{label}: {nothing}"
    return False, f"{label}: {len(bad)} failing checks ({', '.join(bad[:6])}{', ...' if len(bad) > 6 else ''}), " \
                  f"no expectations file judges them"


def main(args) -> int:
    from conformance.results.compare import load_results
    from conformance.results.matrix import format_matrix

    if args.html is not None:  # before any work: a file that cannot be written is a usage error, not a traceback
        from conformance.suite.prepare import check_output_file

        check_output_file(args.html, "--html", inputs=(*args.results,))
    try:
        rows = [load_results(p) for p in args.results]
    except CompareInputError as exc:
        raise UsageError(str(exc)) from None
    print(format_matrix(rows))
    verdicts = [row_verdict(r) for r in rows]
    for green, why in verdicts:
        print(f"{'  ok  ' if green else '  FAIL'} {why}")
    if args.html:
        from conformance.results.files import atomic_write
        from conformance.results.html import render

        args.html.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.html, render(rows, base=args.html.parent, title="hybrid-cache-conformance: matrix"))
        print(f"wrote {args.html}")
    return 0 if all(green for green, _ in verdicts) else 1
