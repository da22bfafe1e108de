"""``hybrid-conformance matrix RESULTS...``: several runs side by side, by
check family (the reference, vLLM at both levels, SGLang: each run in its own
environment, each a results.json or a report directory)."""

from __future__ import annotations

from pathlib import Path

from conformance.errors import CompareInputError, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("matrix", help="several runs side by side, one row per run, one column per family")
    p.add_argument("results", type=Path, nargs="+", help="results.json files or report directories")
    p.add_argument("--html", type=Path, default=None, metavar="FILE", help="also write the matrix as HTML")
    p.set_defaults(func=main)


def main(args) -> int:
    from conformance.results.compare import load_results
    from conformance.results.matrix import format_matrix

    try:
        rows = [load_results(p) for p in args.results]
    except CompareInputError as exc:
        raise UsageError(str(exc)) from None
    print(format_matrix(rows))
    if args.html:
        from conformance.results.files import atomic_write
        from conformance.results.html import render

        args.html.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.html, render(rows, base=args.html.parent, title="hybrid-cache-conformance: matrix"))
        print(f"wrote {args.html}")
    return 0 if all(r.get("checks") for r in rows) else 1
