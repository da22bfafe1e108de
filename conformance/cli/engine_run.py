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
    ("faults", None, "--faults", "it injects no environment faults (its planted faults are the option fault=...)"),
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
    if args.expectations:
        from conformance.cli.common import load_expectations_for_cli
        from conformance.suite.prepare import check_expectations_engine

        exp = load_expectations_for_cli(args.expectations)  # a bad file is a usage error now, before the engines start
        check_expectations_engine(exp.doc, exp.path, args.impl, args.impl)  # another engine's file too
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
        facts = engine_facts(args.profile, options.given)
        for c in results:
            c.facts = facts.get(c.id, {})
        from conformance.cli.common import engine_check_ids
        from conformance.suite.known import as_dict, expectations_for

        expectations = expectations_for(args.impl, result.implementation_version, args.expectations,
                                        engine_check_ids())
        result.expectations = as_dict(expectations)
        if expectations is not None:
            result.defect_replays = replay_engine_pinned(expectations, result, options.given)
        _write_engine_repros(reports.path, result, options.given)
        result.finished = _now()
        reports.finish(result)
    result.metrics["report_dir"] = str(reports.path)
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    if result.expectations:
        from conformance.results.triage import format_verdict, judge_file

        doc = result.to_dict()
        verdict, exp = judge_file(doc, result.expectations["path"])
        print(format_verdict(verdict, exp, result.expectations["path"], doc), file=sys.stderr)
        return 0 if verdict.ok and result.checked else 1
    return 0 if result.ok else 1


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def engine_facts(profile: str, options: dict) -> dict[str, dict]:
    """Check id -> the facts a known defect's conditions are judged on: the
    model, the variant and every option it runs with (nested options as
    dotted keys: ``pd_decode.block_size``), the check's family, the device."""
    from conformance.engine import planned_checks

    out = {}
    for v in planned_checks(profile, options):
        merged = _flatten({**options, **v.options})
        merged.setdefault("device", "cpu")
        for family in (*v.families, "reference-agreement"):
            out[f"engine-{family}:{v.key}"] = {**merged, "model": v.model, "variant": v.variant, "family": family}
    return out


def replay_engine_pinned(expectations, result, options: dict, every: bool = False) -> list[dict]:
    """Each open defect's engine-level pinned repro: one engine check at the
    profile, seed and options it was pinned with.  The run's own result of
    that check is its replay when the run used exactly those; otherwise the
    check runs again (an engine start, or two for P/D).  A run replays only
    the repros whose check its own profile plans (a quick run does not start
    the full profile's engines); the others are "not replayed", said, and
    ``defects --impl vllm-engine --replay`` (``every``) replays them all."""
    from conformance.engine import run_engine_checks
    from conformance.results.pinned import load_any

    out = []
    by_id = {c.id: c for c in result.checks}
    for defect in expectations.table.open():
        if defect.repro is None:
            continue
        pinned = load_any(defect.repro)
        if pinned.level != "engine":
            continue
        doc = pinned.doc
        record = {"defect": defect.id, "repro": str(defect.repro), "operations": 1}
        if not every and doc["check"] not in engine_facts(result.profile, options):
            out.append({**record, "outcome": "not replayed",
                        "note": f"its check {doc['check']} is in profile {doc['profile']}, not {result.profile}: "
                                f"hybrid-conformance defects --impl vllm-engine --replay replays it"})
            continue
        same = (doc["profile"] == result.profile and doc["seed"] == result.seed and doc["options"] == options)
        check = by_id.get(doc["check"]) if same else None
        if check is None:
            print(f"  replaying the pinned repro of {defect.id}: {doc['check']} (profile {doc['profile']}, seed "
                  f"{doc['seed']})", file=sys.stderr, flush=True)
            try:
                _info, ran = run_engine_checks(doc["profile"], doc["seed"], doc["options"], checks=(doc["check"],))
            except ValueError as exc:
                out.append({**record, "outcome": "changed", "kind": "harness", "message": str(exc)})
                continue
            check = next((c for c in ran if c.id == doc["check"]), None)
        if check is None or check.status == "skipped":
            out.append({**record, "outcome": "not replayed",
                        "note": check.reason if check is not None else "the check did not run"})
        elif check.status == "passed":
            out.append({**record, "outcome": "fixed"})
        else:
            f = check.failure
            match = expectations.table.classify(f.kind if f else None, f.message if f else "", pinned.facts)
            reproduces = match is not None and match.defect.id == defect.id
            out.append({**record, "outcome": "reproduces" if reproduces else "changed",
                        "kind": f.kind if f else check.status, "message": (f.message if f else "")[:500]})
    return out


def _write_engine_repros(out: Path, result, options: dict) -> None:
    """``repros/<check>.json`` for each failed engine check: the engine-level
    repro (the check, profile, seed and options: running it again is its replay)."""
    import json

    from conformance.results.files import atomic_write
    from conformance.results.pinned import engine_repro_document

    for c in result.checks:
        if c.status in ("failed", "error") and c.failure is not None:
            (out / "repros").mkdir(parents=True, exist_ok=True)
            path = out / "repros" / f"{c.id}.json"
            atomic_write(path, json.dumps(engine_repro_document(c, result, options, c.facts), indent=2) + "\n")
            c.failure.repro = str(path)
