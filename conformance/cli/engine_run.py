"""``run --impl vllm-engine``: the engine-level checks (conformance.engine)
reported through the same results.json / junit.xml / index.html as every run."""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.cli.common import parse_options, summary_lines
from conformance.results import report
from conformance.results.compare import find_expectations, format_expectations
from conformance.results.records import RunResult
from conformance.suite.options import default_report_dir
from conformance.suite.options import now as _now


def run_engine(args) -> int:
    from conformance.engine import PROFILES, run_engine_checks
    from conformance.errors import UsageError

    if args.profile not in PROFILES:
        raise UsageError(f"--profile {args.profile!r}: the vllm-engine adapter has the profiles "
                         f"{', '.join(PROFILES)}")
    if getattr(args, "mutant", None):
        raise UsageError(f"--mutant {args.mutant}: the vllm-engine adapter takes no mutant (its planted faults are "
                         f"the option fault=...)")
    options = parse_options(args.option)
    result = RunResult(implementation="vllm-engine", implementation_version="", seed=args.seed,
                       profile=args.profile, started=_now(), impl_spec=args.impl, impl_config={"options": options})
    out = Path(args.report_dir or default_report_dir(args.impl, args.seed))
    out.mkdir(parents=True, exist_ok=True)
    try:
        info, checks = run_engine_checks(args.profile, args.seed, options,
                                         progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
                                         checks=tuple(getattr(args, "check", None) or ()))
    except ValueError as e:  # a --check id this profile does not plan
        print(f"vllm-engine: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        result.interrupted = True
        report.write_all(out, result)
        raise
    result.implementation_version = info.get("implementation_version", "")
    result.checks = checks
    result.metrics = {"engine": info, "report_dir": str(out)}
    result.finished = _now()
    report.write_all(out, result)
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    expectations = args.expectations or find_expectations(args.impl, result.implementation_version)
    if expectations:
        text, as_expected = format_expectations(result.to_dict(), expectations)
        print(text, file=sys.stderr)
        return 0 if as_expected and result.checked else 1
    return 0 if result.ok else 1
