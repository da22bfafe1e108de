"""``hybrid-conformance run``: the conformance suite against one implementation."""

from __future__ import annotations

import sys

from ..run import RunOptions, run
from .common import Progress, add_impl_options, parse_options


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run the conformance checks against an implementation")
    add_impl_options(p)
    p.add_argument("--profile", default="quick", help="quick, standard or nightly (default quick)")
    p.add_argument("--check", action="append", default=[], help="run only this check id (repeatable)")
    p.add_argument("--mutant", default=None, help="apply one registered mutant to the implementation")
    p.add_argument("--faults", default="", help="environment faults to inject, comma separated")
    p.add_argument("--examples", type=int, default=None, help="Hypothesis examples per check (overrides profile)")
    p.add_argument("--steps", type=int, default=None, help="operations per example (overrides profile)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.impl in ("vllm-engine",):
        from ..engine_entry import run_engine

        return run_engine(args)
    opts = RunOptions(impl=args.impl, profile=args.profile, seed=args.seed, report_dir=args.report_dir,
                      checks=tuple(args.check), mutant=args.mutant,
                      faults=tuple(f for f in args.faults.split(",") if f), timeout=args.timeout,
                      examples=args.examples, steps=args.steps, impl_options=parse_options(args.option),
                      block_size=args.block_size, progress=Progress())
    result = run(opts)
    summary = result.to_dict()["summary"]
    print(f"{result.implementation} {result.implementation_version}: {summary['passed']} passed, "
          f"{summary['failed']} failed, {summary['error']} errors; reports in {result.metrics.get('report_dir')}",
          file=sys.stderr)
    return 0 if result.ok else 1
