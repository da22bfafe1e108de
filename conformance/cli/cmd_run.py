"""``hybrid-conformance run``: the conformance suite against one implementation."""

from __future__ import annotations

import signal
import sys

from conformance.cli.common import Progress, add_impl_options, parse_options, positive_int, summary_lines, terminated
from conformance.cli.supervise import first_signal_only, tell_parent
from conformance.errors import UsageError
from conformance.suite.prepare import prepare_run
from conformance.suite.run import RunOptions, execute


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run the conformance checks against an implementation")
    add_impl_options(p)
    p.add_argument("--profile", default="quick", help="quick, standard or nightly (default quick)")
    p.add_argument("--check", action="append", default=[], help="run only this check id (repeatable)")
    p.add_argument("--mutant", default=None, help="apply one registered mutant to the implementation")
    p.add_argument("--faults", default=None, help="environment faults to inject, comma separated")
    p.add_argument("--examples", type=positive_int, default=None,
                   help="Hypothesis examples per check (overrides profile)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="Hypothesis steps per example: rule calls, each applying one or more operations "
                        "(overrides profile)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only share I of N of the checks (1-based; for CI matrices)")
    p.add_argument("--workers", type=positive_int, default=1, help="run checks in N processes on this machine")
    p.add_argument("--no-matrix", action="store_true",
                   help="run each check once, not under the implementation's configuration matrix")
    p.add_argument("--shrink", default="ops", choices=("ops", "hypothesis+ops", "hypothesis", "none"),
                   help="how a failure is minimized: by replaying subsets of its operations until none can go "
                        "(default: seconds, every repro minimal), Hypothesis's shrinker first and then that "
                        "(minutes), Hypothesis's shrinker alone, or not at all")
    p.add_argument("--expectations", default=None, metavar="TOML",
                   help="exit by an expectations file (fixtures/expectations/<engine>-<version>.toml): "
                        "1 only for unexpected failures or passes")
    p.set_defaults(func=main)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = None
    if not sep or shard is None or not 1 <= shard[0] <= shard[1]:
        raise UsageError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return shard


def _no_expectations(result, impl: str) -> None:
    """A version (and build) without an expectations file: said on the console and in results.json,
    so that a raw verdict is never read as a judged one (docs/upgrading-vllm.md: writing one)."""
    from conformance.results import report
    from conformance.results.expectations import EXPECTATIONS_DIR

    label = " ".join(x for x in (result.implementation_build or result.implementation,
                                 result.implementation_version) if x)
    note = (f"no expectations file for --impl {impl} on {label} in {EXPECTATIONS_DIR}: the exit status is the raw "
            f"verdict (every failure counts); known defects are not told apart")
    print(note, file=sys.stderr)
    result.metrics["expectations"] = {"path": None, "note": note}
    out = result.metrics.get("report_dir")
    if out:
        from pathlib import Path

        report.write_all(Path(out), result)


def options_from(args) -> RunOptions:
    """The run the command line asks for."""
    return RunOptions(impl=args.impl, profile=args.profile, seed=args.seed, report_dir=args.report_dir,
                      checks=tuple(args.check), mutant=args.mutant,
                      faults=tuple(args.faults.split(",")) if args.faults is not None else (), timeout=args.timeout,
                      examples=args.examples, steps=args.steps, impl_options=parse_options(args.option),
                      block_size=args.block_size, num_kv_blocks=args.kv_blocks, num_state_slots=args.state_slots,
                      progress=Progress(), shard=parse_shard(args.shard),
                      shrink=args.shrink, workers=args.workers, matrix=not args.no_matrix,
                      expectations=args.expectations)


def main(args) -> int:
    # A CI runner cancels with SIGTERM: the run stops as on Ctrl-C (it marks
    # itself interrupted and keeps its reports) and exits 143 (SIGKILL cannot
    # be caught; the reports written before the first check and after each still hold).
    signal.signal(signal.SIGTERM, terminated)
    first_signal_only()  # under the supervisor (cli/supervise.py): a signal delivered twice stops it once
    opts = options_from(args)  # --impl vllm-engine too: prepare_run makes it an engine-level Run
    if args.expectations:
        from conformance.cli.common import load_expectations_for_cli

        load_expectations_for_cli(args.expectations)  # a typo should fail now, not after the run (exit 2)
    run = prepare_run(opts)  # every usage error is raised here, before any work
    tell_parent(run.report_dir)
    result = execute(run)
    return render(result, args.impl, args.mutant)


def render(result, impl: str, mutant: str | None = None) -> int:
    """The run's verdict on the console (the summary, the triage, then one
    last line: ``verdict: ...``) and as the exit status: the value the core
    decided (``result.verdict``), never judged again here."""
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    verdict = result.verdict
    if result.expectations:
        from conformance.results.triage import format_verdict, judge_file

        doc = result.to_dict()
        triage, exp = judge_file(doc, result.expectations["path"])
        text = format_verdict(triage, exp, result.expectations["path"], doc).splitlines()
        print("\n".join(text[:-1]), file=sys.stderr)  # its last line ("as expected") is the verdict's now
    elif result.implementation != "reference" and not mutant:
        _no_expectations(result, impl)
    print(verdict.headline(), file=sys.stderr)
    return verdict.exit_code
