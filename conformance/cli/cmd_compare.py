"""``hybrid-conformance compare OLD NEW``: what changed between two runs.

OLD and NEW are results.json files (or report directories).  OLD may instead
be an expectations file (``fixtures/expectations/<engine>-<version>.toml``).
Exit 1 when something regressed (a new failure, a check that no longer ran, a
coverage counter that fell to 0, an interrupted run) or, against
expectations, when a result is not the expected one."""

from __future__ import annotations

from conformance.cli.common import path_arg
from conformance.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="compare two results.json files (or a results file with expectations)")
    p.add_argument("old", type=path_arg, help="results.json / report dir of the earlier run, or an expectations .toml")
    p.add_argument("new", type=path_arg, help="results.json / report dir of the later run")
    p.add_argument("more", type=path_arg, nargs="*", help="further results for the HTML matrix (--html)")
    p.add_argument("--html", type=path_arg, default=None, metavar="FILE",
                   help="also write an HTML matrix with one row per results file")
    p.set_defaults(func=main)


def main(args) -> int:
    from conformance.errors import CompareInputError
    from conformance.results.compare import compare, defect_lines, format_comparison, format_expectations, load_results

    if args.html is not None:  # before any work: a file that cannot be written is a usage error, not a traceback
        from conformance.suite.prepare import check_output_file

        check_output_file(args.html, "--html", inputs=(args.old, args.new, *args.more))
    try:
        old = None if args.old.suffix == ".toml" else load_results(args.old)  # in the order given
        new = load_results(args.new)
        if old is None:
            from conformance.cli.common import load_expectations_for_cli

            load_expectations_for_cli(args.old)  # every entry validated: a typo check id or a bad defect is exit 2
            text, ok = format_expectations(new, args.old)
            print(text)
            rows = [new]
        else:
            cmp = compare(old, new)
            print(format_comparison(cmp, str(args.old), str(args.new), first=defect_lines(cmp)))
            ok = not cmp.regressed
            rows = [old, new]
        rows += [load_results(p) for p in args.more]
    except CompareInputError as exc:
        raise UsageError(str(exc)) from None
    if args.html:
        from conformance.results.files import atomic_write
        from conformance.results.html import render

        args.html.parent.mkdir(parents=True, exist_ok=True)
        # The page embeds no plots: the folder it is written to may hold other runs' PNGs.
        atomic_write(args.html, render(rows, base=args.html.parent, title="hybrid-cache-conformance: comparison"))
        print(f"wrote {args.html}")
    return 0 if ok else 1
