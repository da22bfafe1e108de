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
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
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
