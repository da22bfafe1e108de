"""``run --impl vllm-engine``: the engine-level checks (conformance.engine)
reported through the same results.json / junit.xml / index.html as every run
(:class:`~conformance.results.report.ReportDir`)."""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.cli.common import parse_options, summary_lines
from conformance.engine.references import HF_TIMEOUT
from conformance.engine.vllm_engine import CALL_TIMEOUT, STARTUP_TIMEOUT
from conformance.errors import UsageError
from conformance.results.compare import find_expectations, format_expectations
from conformance.results.records import RunResult
from conformance.results.report import ReportDir
from conformance.suite.options import default_report_dir
from conformance.suite.options import now as _now

# The flags of `run` that the engine-level checks have no use for (they run no
# Hypothesis machine, inject no environment faults, run in one process), each
# with what it would have meant: given, they are refused, never ignored.
_REFUSED = (
    ("shard", None, "--shard", "its checks run in one process (a split of them is not implemented)"),
    ("workers", 1, "--workers", "its checks run in one process"),
    ("faults", "", "--faults", "it injects no environment faults (its planted faults are the option fault=...)"),
    ("examples", None, "--examples", "its workloads are fixed per profile, not Hypothesis examples"),
    ("steps", None, "--steps", "its workloads are fixed per profile, not Hypothesis steps"),
    ("block_size", None, "--block-size", "the engine chooses its block size"),
    ("kv_blocks", None, "--kv-blocks", "the engine sizes its own pools (the option eviction_blocks=...)"),
    ("state_slots", None, "--state-slots", "the engine sizes its own pools"),
    ("no_matrix", False, "--no-matrix", "it has no configuration matrix (its variants are the profile's)"),
    ("shrink", "ops", "--shrink", "its failures are workload rounds, not minimized"),
    ("timeout", 30.0, "--timeout", f"it times its engine's calls itself (start-up {STARTUP_TIMEOUT:.0f} s, a "
                                   f"generation {CALL_TIMEOUT:.0f} s, the transformers reference {HF_TIMEOUT:.0f} s)"),
)


def refuse_unsupported(args) -> None:
    """A usage error (exit 2) for every flag the engine-level run would ignore."""
    from conformance.engine import PROFILES

    if args.profile not in PROFILES:
        raise UsageError(f"--profile {args.profile!r}: the vllm-engine adapter has the profiles "
                         f"{', '.join(PROFILES)}")
    if getattr(args, "mutant", None):
        raise UsageError(f"--mutant {args.mutant}: the vllm-engine adapter takes no mutant (its planted faults are "
                         f"the option fault=...)")
    for attr, default, flag, why in _REFUSED:
        if getattr(args, attr, default) != default:
            raise UsageError(f"{flag}: the vllm-engine adapter does not take it: {why}")


def run_engine(args) -> int:
    from conformance.engine import EngineOptions, planned_check_ids, run_engine_checks
    from conformance.suite.prepare import check_report_dir

    refuse_unsupported(args)
    options = EngineOptions.parse(parse_options(args.option))  # an unknown key: a usage error, now
    checks = tuple(getattr(args, "check", None) or ())
    try:
        planned = planned_check_ids(args.profile, options, checks)
    except ValueError as e:  # a --check id this profile does not plan
        raise UsageError(f"--check: {e}") from None
    if args.report_dir is not None:
        check_report_dir(Path(args.report_dir))
    result = RunResult(implementation="vllm-engine", implementation_version="", seed=args.seed,
                       profile=args.profile, started=_now(), impl_spec=args.impl,
                       impl_config={"options": options.given})
    reports = ReportDir(Path(args.report_dir) if args.report_dir else default_report_dir(args.impl, args.seed))
    with reports.open():
        try:
            info, results = run_engine_checks(args.profile, args.seed, options,
                                              progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
                                              checks=checks)
        except BaseException as exc:  # a signal, or the engine run raised
            result.interrupted = True
            if not isinstance(exc, KeyboardInterrupt):
                result.crashed = f"{type(exc).__name__}: {exc}"
            result.not_run = planned  # the engine run returns its results at the end: none is kept
            result.finished = _now()
            reports.write(result)
            raise
        result.implementation_version = info.get("implementation_version", "")
        result.checks = results
        result.metrics = {"engine": info}
        result.finished = _now()
        reports.finish(result)
    result.metrics["report_dir"] = str(reports.path)
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    expectations = args.expectations or find_expectations(args.impl, result.implementation_version)
    if expectations:
        text, as_expected = format_expectations(result.to_dict(), expectations)
        print(text, file=sys.stderr)
        return 0 if as_expected and result.checked else 1
    return 0 if result.ok else 1
