"""``hybrid-conformance``: one subcommand per module ``conformance/cli/cmd_<name>.py``.

Exit codes: 0 all checks passed, 1 a conformance failure (or an unexpected
result), 2 a usage error (with a one-line message naming the problem)."""

from __future__ import annotations

import argparse
import importlib
import sys

from conformance.errors import UsageError

COMMANDS = ("run", "mutants", "replay", "compare", "matrix", "economics", "defects")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; one line is kinder in CI logs
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybrid-conformance",
                     description="Conformance suite and fault injection for hybrid LLM caches.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"conformance.cli.cmd_{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv[1:]``).  From the console
    (no ``argv``), ``run`` executes under a supervisor (cli/supervise.py): a
    run whose process dies still ends with a verdict and exit status 1."""
    if argv is None:
        from conformance.cli.supervise import supervise, wanted

        if wanted(sys.argv[1:]):
            return supervise(sys.argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if argv is None:  # from the console, this process ends with the command
            from conformance.suite.prepared import freeze_heap

            freeze_heap()
        try:
            return int(args.func(args) or 0)
        except SystemExit as exc:
            # Inside a command only code it runs can raise it (the implementation's, outside any guarded
            # call: its warm-up...): never a run's end with that status.  The report says "crashed".
            print(f"hybrid-conformance: error: SystemExit({exc.code!r}) was raised during the command (by the "
                  f"implementation's code, outside any check); the run is incomplete", file=sys.stderr)
            return 1
    except UsageError as exc:
        print(f"hybrid-conformance: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from conformance.cli.common import Terminated

        signal = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        print(f"hybrid-conformance: interrupted ({signal}); results so far are in the report directory, the "
              f"checks that did not run are listed as not run", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
