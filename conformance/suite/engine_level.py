"""The engine level as a kind of run: ``--impl vllm-engine`` is prepared by
:func:`conformance.suite.prepare.prepare_run` into a :class:`~conformance.suite.prepared.Run`
whose ``engine`` plan holds the engine's options and check ids, and executed
by the one :func:`conformance.suite.run.execute`, which calls
:func:`execute_engine` here for its checks.  The verdict, the reports and
the exit status are every run's (nothing here renders or judges).

An engine check is a fixed workload per profile and seed (no Hypothesis), run
by a whole engine in a worker process (:mod:`conformance.engine`); its
failures are workload rounds, not minimized; its pinned repros are engine
checks run again (:func:`replay_engine_pinned`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.errors import UsageError
from conformance.results.records import RunResult

# The options of `run` that the engine-level checks have no use for (they run no Hypothesis machine,
# inject no environment faults, run in one process), each with its default and what it would have meant:
# given, they are refused, never ignored.
_REFUSED = (
    ("shard", None, "--shard", "its checks run in one process (a split of them is not implemented)"),
    ("workers", 1, "--workers", "its checks run in one process"),
    ("faults", (), "--faults", "it injects no environment faults (its planted faults are the option fault=...)"),
    ("examples", None, "--examples", "its workloads are fixed per profile, not Hypothesis examples"),
    ("steps", None, "--steps", "its workloads are fixed per profile, not Hypothesis steps"),
    ("block_size", None, "--block-size", "the engine chooses its block size"),
    ("num_kv_blocks", None, "--kv-blocks", "the engine sizes its own pools (the option eviction_blocks=...)"),
    ("num_state_slots", None, "--state-slots", "the engine sizes its own pools"),
    ("matrix", True, "--no-matrix", "it has no configuration matrix (its variants are the profile's)"),
    ("shrink", "ops", "--shrink", "its failures are workload rounds, not minimized"),
)


@dataclass(frozen=True)
class EnginePlan:
    """What an engine-level run runs: the engine's typed options
    (:class:`conformance.engine.options.EngineOptions`), the check ids asked
    for (``--check``; empty: the profile's) and the ids the run plans."""

    options: Any
    asked: tuple[str, ...]
    planned: tuple[str, ...]
    profile: str
    given: dict = field(default_factory=dict)  # the options as the user gave them (results.json, repros)


def no_cache_level(config):
    """The factory of an engine-level Run: there is no cache-level implementation to build."""
    raise UsageError("--impl vllm-engine runs whole engines: it has no cache-level implementation")


def prepare_engine(opts, plan: EnginePlan):
    """The Run of an engine-level ``opts`` and its ``plan`` (:func:`plan_engine`;
    ``prepare_run`` validated both before any engine starts or any directory is made)."""
    from dataclasses import replace

    from conformance.engine import IMPLEMENTATION
    from conformance.suite.checks import Profile
    from conformance.suite.known import load_for_run
    from conformance.suite.options import default_model_config, default_report_dir
    from conformance.suite.prepared import PoolSizes, Run

    # a file named on the command line is validated now; the one written for the engine's version is
    # found after the run, when an engine has said its version
    expectations = load_for_run(opts.expectations, engine_check_ids()) if opts.expectations else None
    if expectations is not None:  # another engine's file is a usage error (conformance.suite.known)
        from conformance.suite.known import check_expectations_engine

        check_expectations_engine(expectations.doc, expectations.path, opts.impl, IMPLEMENTATION)
    report_dir = None
    if opts.write_reports:
        report_dir = Path(opts.report_dir) if opts.report_dir is not None else default_report_dir(opts.impl, opts.seed)
    return Run(impl=opts.impl, factory=no_cache_level, name=IMPLEMENTATION, version="",
               profile=Profile(opts.profile, examples=0, hypothesis_steps=0, checks=()), seed=opts.seed, checks=(),
               selected=len(plan.planned), impl_options=plan.given, tier_option=None, spec_option=None, mutant=None,
               faults=(), model_config=opts.model_config or default_model_config(), examples=0, examples_asked=None,
               hypothesis_steps=0, timeout=opts.timeout, shrink=opts.shrink, pools=PoolSizes(),
               report_dir=report_dir, workers=1, shard=None, stop_at_failure=opts.stop_at_failure,
               matrix=opts.matrix, options=replace(opts, impl_options=dict(opts.impl_options)),
               expectations=expectations, engine=plan)


def engine_check_ids() -> set[str]:
    """Every engine-level check id any engine profile plans (an expectations
    entry for another ``engine-*`` id is a typo)."""
    from conformance.engine import ALL, PROFILES

    ids = set()
    for profile in PROFILES.values():
        for model, variant, families, _options in profile["variants"]:
            key = model + (f"+{variant}" if variant else "")
            ids |= {f"engine-{f}:{key}" for f in (*families, *ALL, "reference-agreement")}
    return ids


def plan_engine(opts) -> EnginePlan:
    """The engine-level plan of ``opts`` (a RunOptions); a usage error (exit 2,
    before any engine starts) for a flag it would ignore, an unknown profile,
    option or check."""
    from conformance.engine import PROFILES, EngineOptions, planned_check_ids
    from conformance.engine.references import HF_TIMEOUT
    from conformance.engine.vllm_engine import CALL_TIMEOUT, STARTUP_TIMEOUT

    if opts.profile not in PROFILES:
        raise UsageError(f"--profile {opts.profile!r}: the vllm-engine adapter has the profiles "
                         f"{', '.join(PROFILES)}")
    if opts.mutant:
        raise UsageError(f"--mutant {opts.mutant}: the vllm-engine adapter takes no mutant (its planted faults are "
                         f"the option fault=...)")
    for attr, default, flag, why in _REFUSED:
        if getattr(opts, attr) != default:
            raise UsageError(f"{flag}: the vllm-engine adapter does not take it: {why}")
    if opts.timeout != 30.0:
        raise UsageError(f"--timeout: the vllm-engine adapter does not take it: it times its engine's calls itself "
                         f"(start-up {STARTUP_TIMEOUT:.0f} s, a generation {CALL_TIMEOUT:.0f} s, the transformers "
                         f"reference {HF_TIMEOUT:.0f} s)")
    options = EngineOptions.parse(dict(opts.impl_options))  # an unknown key: a usage error, now
    asked = tuple(opts.checks)
    try:
        planned = planned_check_ids(opts.profile, options, asked)
    except ValueError as e:  # a --check id this profile does not plan
        raise UsageError(f"--check: {e}") from None
    return EnginePlan(options=options, asked=asked, planned=tuple(planned), profile=opts.profile,
                      given=dict(options.given))


def execute_engine(run, result: RunResult, reports, notify) -> None:
    """Run the engine-level checks of ``run`` (``run.engine``) into ``result``:
    the checks, their facts, the expectations file of the engine's version
    (known only once an engine has started) and its pinned repros, the repro
    files.  The engine run returns its results at the end: a run stopped
    before keeps none (every planned check not run)."""
    from conformance.engine import run_engine_checks
    from conformance.suite.known import as_dict, expectations_for

    plan = run.engine
    info, results = run_engine_checks(plan.profile, run.seed, plan.options,
                                      progress=lambda msg: notify("engine", message=msg), checks=plan.asked)
    result.implementation_version = info.get("implementation_version", "")
    facts = engine_facts(plan.profile, plan.given)
    for c in results:
        c.facts = facts.get(c.id, {})
        result.add_check(c)
    for cid in list(result.not_run):
        # a variant whose engine could not run here returns its families skipped, not the agreement check
        # of its references: skipped for the same reason, never "not run"
        variant = cid.split(":", 1)[-1]
        sibling = next((c for c in results if c.status == "skipped" and c.id.split(":", 1)[-1] == variant), None)
        if sibling is not None:
            from conformance.engine.checks import DESCRIPTIONS
            from conformance.results.records import CheckResult

            family = cid.split(":", 1)[0].removeprefix("engine-")
            result.add_check(CheckResult(id=cid, family=f"engine-{family}", status="skipped",
                                         description=DESCRIPTIONS.get(family, ""), reason=sibling.reason,
                                         facts=facts.get(cid, {})))
    result.metrics["engine"] = info
    expectations = expectations_for(run.impl, result.implementation_version, run.options.expectations,
                                    engine_check_ids())
    result.expectations = as_dict(expectations)
    if expectations is not None:
        result.defect_replays = replay_engine_pinned(expectations, result, plan.given)
    if reports is not None:
        write_engine_repros(reports.path, result, plan.given)


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


def write_engine_repros(out: Path, result, options: dict) -> None:
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
