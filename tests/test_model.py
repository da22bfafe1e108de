"""The two model paths agree, and the cached path is sensitive to exactly the
mistakes a cache makes (wrong KV, a neighbouring position's state, a state
without its conv part)."""

import random

import pytest
import torch

from conformance.model import ModelConfig, RecState, TinyHybrid


def _seq(n, seed=1, vocab=64):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _chunked(model, tokens, chunks):
    """Run ``tokens`` through the cached path in the given chunk sizes, keeping
    the KV and states in plain tensors (no paging): returns logits, KV, states."""
    c = model.config
    kv = [(torch.zeros(0, c.attn_heads, c.head_dim, dtype=model.dtype),) * 2 for _ in range(c.num_attn_layers)]
    states = [model.zero_state() for _ in range(c.num_rec_layers)]
    outs, pos, history = [], 0, {0: [RecState(s.conv.clone(), s.ssm.clone()) for s in states]}
    for k in chunks:
        o = model.step(tokens[pos:pos + k], pos, kv, states)
        kv = [(torch.cat([a, na]), torch.cat([b, nb])) for (a, b), (na, nb) in zip(kv, o.new_kv)]
        states = o.states
        outs.append(o.logits)
        pos += k
        history[pos] = states
    return torch.cat(outs), kv, history


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunks", [[40], [1] * 40, [5, 1, 7, 11, 16], [3, 3, 3, 31]])
def test_cached_path_matches_reference(model, chunks):
    tokens = _seq(40)
    ref = model.reference(tokens)
    got, _, _ = _chunked(model, tokens, chunks)
    assert _rel(got, ref) <= 1e-9


def test_snapshot_capture_equals_state_at_that_position(model):
    tokens = _seq(20)
    _, _, history = _chunked(model, tokens, [7, 13])
    c = model.config
    kv = [(torch.zeros(0, c.attn_heads, c.head_dim, dtype=model.dtype),) * 2 for _ in range(c.num_attn_layers)]
    out = model.step(tokens[:20], 0, kv, [model.zero_state() for _ in range(c.num_rec_layers)], capture=(7,))
    for got, want in zip(out.captured[7], history[7]):
        assert torch.allclose(got.conv, want.conv, rtol=0, atol=1e-12)
        assert torch.allclose(got.ssm, want.ssm, rtol=0, atol=1e-12)


def _resume(model, tokens, start, kv, states):
    past = [(k[:start], v[:start]) for k, v in kv]
    return model.step(tokens[start:], start, past, states).logits


def test_sensitivity_to_cache_mistakes(model):
    tokens = _seq(32, seed=3)
    ref = model.reference(tokens)
    _, kv, history = _chunked(model, tokens, [12, 1, 19])
    start = 12
    assert _rel(_resume(model, tokens, start, kv, history[12]), ref[start:]) <= 1e-9
    # the state of a neighbouring position
    assert _rel(_resume(model, tokens, start, kv, history[13]), ref[start:]) >= 1e-3
    # a state without its conv part (matrix state right, conv state zeroed)
    no_conv = [RecState(torch.zeros_like(s.conv), s.ssm) for s in history[12]]
    assert _rel(_resume(model, tokens, start, kv, no_conv), ref[start:]) >= 1e-3
    # wrong KV: another sequence's KV for the prefix
    _, other_kv, _ = _chunked(model, _seq(32, seed=4), [32])
    assert _rel(_resume(model, tokens, start, other_kv, history[12]), ref[start:]) >= 1e-3
    # KV one position off
    shifted = [(torch.cat([k[1:], k[-1:]]), torch.cat([v[1:], v[-1:]])) for k, v in kv]
    assert _rel(_resume(model, tokens, start, shifted, history[12]), ref[start:]) >= 1e-3


def test_weights_are_deterministic_and_seeded():
    a, b = TinyHybrid(ModelConfig(seed=5)), TinyHybrid(ModelConfig(seed=5))
    c = TinyHybrid(ModelConfig(seed=6))
    toks = _seq(10)
    assert torch.equal(a.reference(toks), b.reference(toks))
    assert not torch.equal(a.reference(toks), c.reference(toks))


def test_float32_paths_agree_within_float32_tolerance():
    m = TinyHybrid(ModelConfig(), dtype=torch.float32)
    tokens = _seq(24)
    got, _, _ = _chunked(m, tokens, [5, 19])
    assert _rel(got, m.reference(tokens)) <= 1e-4


def test_bad_pattern_is_rejected():
    with pytest.raises(ValueError, match="R, A and W"):
        ModelConfig(pattern="RRX")
    with pytest.raises(ValueError, match="hybrid"):
        ModelConfig(pattern="RRR")


def _delta_rule_by_einsum(S, q, k, v, decay, beta):
    """The gated delta rule as the design note writes it, one einsum a product."""
    outs = []
    for t in range(q.shape[0]):
        S = S * decay[t][:, None, None]
        v_old = torch.einsum("hvk,hk->hv", S, k[t])
        S = S + beta[t][:, None, None] * torch.einsum("hv,hk->hvk", v[t] - v_old, k[t])
        outs.append(torch.einsum("hvk,hk->hv", S, q[t]))
    return torch.stack(outs), S


@pytest.mark.parametrize("form", ["_delta_rule", "_delta_rule_loop", "_delta_rule_chunk"])
@pytest.mark.parametrize("T", [1, 4, 5, 37, 300])
def test_the_delta_rule_is_the_einsum_formulation(T, form):
    """The model's delta rule goes token by token for short chunks and in
    closed form for longer ones (bench/core.py: the oracle's time); each form,
    at every length, must compute what the design note's einsum form does,
    with the states captured inside the chunk, far inside the float64
    tolerance (1e-9)."""
    m = TinyHybrid(ModelConfig())
    c, dtype = m.config, torch.float64
    g = torch.Generator().manual_seed(3)
    H, K, V = c.rec_heads, c.rec_key_dim, c.rec_value_dim
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    # decays from sharp (near 0: e^{g} underflows over a long chunk) to near 1
    decay = torch.sigmoid(4 * torch.randn(T, H, generator=g, dtype=dtype) + 2)
    beta = torch.rand(T, H, generator=g, dtype=dtype)
    S0 = torch.randn(H, V, K, generator=g, dtype=dtype)
    captured = {}
    at = {1, T // 2 or 1, T}
    got, got_S = getattr(m, form)(S0, q, k, v, decay, beta, at, lambda rel, S: captured.__setitem__(rel, S))
    want, want_S = _delta_rule_by_einsum(S0, q, k, v, decay, beta)
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and torch.allclose(got_S, want_S, rtol=0, atol=1e-12)
    assert sorted(captured) == sorted(at)
    for rel, S in captured.items():
        assert torch.allclose(S, _delta_rule_by_einsum(S0, q[:rel], k[:rel], v[:rel], decay[:rel], beta[:rel])[1],
                              rtol=0, atol=1e-12)
