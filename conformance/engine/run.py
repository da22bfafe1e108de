"""One engine-level run: every planned variant, skipped with the reason where
its engine cannot run here, otherwise run and judged (:mod:`conformance.engine.checks`)."""

from __future__ import annotations

import time

from conformance.engine.availability import engine_unavailable, pd_unavailable
from conformance.engine.options import EngineOptions
from conformance.engine.plan import planned_checks, select_checks
from conformance.engine.profiles import IMPLEMENTATION, PROFILES
from conformance.results.records import CheckResult


def _skipped(variants, reason: str) -> list[CheckResult]:
    from conformance.engine.checks import DESCRIPTIONS, check_id

    return [CheckResult(id=check_id(f, v), family=f"engine-{f}", status="skipped", description=DESCRIPTIONS[f],
                        reason=reason) for v in variants for f in v.families]


def run_engine_checks(profile: str, seed: int, options: EngineOptions | dict | None = None, progress=None,
                      checks=()) -> tuple[dict, list[CheckResult]]:
    """``checks``: check ids to run (default: all the profile plans); only
    their results are returned.  ``options``: typed, or a dict of their fields
    (an unknown key raises UsageError)."""
    from conformance.engine.checks import run_variant
    from conformance.engine.models import load_fixture

    options = EngineOptions.parse(options)
    t0 = time.monotonic()
    variants = select_checks(planned_checks(profile, options), checks)
    size = PROFILES[profile]["size"]
    info: dict = {"implementation": IMPLEMENTATION, "implementation_version": "", "profile": profile, "seed": seed,
                  "models": {}, "variants": {}}
    results: list[CheckResult] = []
    reasons: dict[str, str | None] = {}
    for v in variants:
        dev = options.merged(v.options).device
        if dev not in reasons:
            reasons[dev] = engine_unavailable(options, dev)
        why_not = reasons[dev]
        if why_not:
            results += _skipped([v], why_not)
            continue
        if "pd" in v.families:
            why = pd_unavailable(options)
            if why:  # the P/D family needs nixl beside vLLM; the rest of the variant still runs
                from conformance.engine.checks import Variant

                results += _skipped([Variant(v.model, v.variant, ("pd",), v.options)], why)
                v = Variant(v.model, v.variant, tuple(f for f in v.families if f != "pd"), v.options)
                if not v.families:
                    continue
        fx = load_fixture(v.model)
        info["models"][v.model] = fx.info()
        vinfo, vres = run_variant(v, seed, size, options.merged({"vocab_size": fx.vocab_size,
                                                                 "fixture_dtype": fx.dtype}), progress)
        info["variants"][v.key] = vinfo
        eng = vinfo.get("engine", {})
        if eng.get("version") and not info["implementation_version"]:
            info["implementation_version"] = eng["version"]
        results += vres
    if checks:
        results = [r for r in results if r.id in set(checks)]
    info["seconds"] = round(time.monotonic() - t0, 1)
    # One tolerance summary for the report header (per variant details stay in variants).
    info["tolerances"] = {k: v.get("tolerance") for k, v in info["variants"].items()}
    return info, results
