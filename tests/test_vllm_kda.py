"""Kimi-K3's KDA spec at the scheduler level (issue 35, item 5): the spec as FlashKDA builds it in vLLM 0.33,
KDA beside MambaMixer2 in both group orders (the scheduler takes the first Mamba group's checkpoint alignment
only), and the fix-reverted mutant of vllm#53212 caught by a generic sequence."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")

from drive import apply_all, session_of  # noqa: E402

from conformance.adapters.vllm import VllmCache, compat  # noqa: E402
from conformance.adapters.vllm.config import LAYERS, MIXED_LAYERS, Groups, hybrid_block_size, layer_specs  # noqa: E402
from conformance.contract import ImplConfig, Request, StepResult  # noqa: E402
from conformance.errors import ConformanceFailure  # noqa: E402
from conformance.harness.ops import Drain, Submit  # noqa: E402
from fault_injection.vllm_mutants import VLLM_MUTANTS  # noqa: E402

needs_033 = pytest.mark.skipif(not compat.since("0.33.0"), reason="KDA's checkpoint helper and kda_state_shape "
                                                                  "are read from vLLM 0.33.0's source")
# A 25-token prompt with blocks of 8: its checkpoint (the last block boundary before its last token) is 24,
# 24 tokens into a chunk that starts at 0 -- not a multiple of FlashKDA's 16.  (16 tokens in would be.)
PROMPT = tuple((5 * i + 3) % 64 for i in range(25))


def build(layer: str, **options) -> VllmCache:
    return VllmCache(ImplConfig(options={"layer": layer, "retention_interval": 0, **options}))


@needs_033
def test_kda_spec_is_the_one_flashkda_builds():
    """KimiK3DeltaAttention.get_kv_cache_spec under FlashKDA (models/kimi_k3/nvidia/kda.py:901-909): the GDN
    base spec, one checkpoint block at kda_prefill_checkpoint_alignment("flashkda"), float32 recurrent
    state on "auto", one conv state over q, k and v in equal thirds; the block is raised by the largest
    state page only (KDA does not declare get_prefill_checkpoint_alignment)."""
    import torch
    from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    impl = build("kda")
    spec = impl.kv_cache_config.kv_cache_groups[impl.runner.groups.mamba].kv_cache_spec
    assert spec.num_prefill_checkpoint_blocks == 1
    assert spec.prefill_checkpoint_alignment == kda_prefill_checkpoint_alignment("flashkda") == 16
    assert spec.mamba_type == MambaAttentionBackendEnum.GDN_ATTN
    assert spec.dtypes[1] == torch.float32  # the recurrent state, "auto"
    conv, recurrent = spec.shapes
    heads, d, _ = recurrent
    assert max(conv) == 3 * heads * d and min(conv) == 3  # q, k, v thirds; conv width 4 - 1
    assert impl.opts.block_size == hybrid_block_size(4, "kda") == 8
    assert impl.engine_config()["prefill_checkpoint_alignment"] == 16


@needs_033
@pytest.mark.parametrize("layer", LAYERS)
def test_groups_are_the_ones_vllm_makes(layer):
    """The adapter's groups are what vLLM's own grouping makes of the layers (kv_cache_planning.py:
    get_kv_cache_groups, the engine core's path), in the same order: the order decides the scheduler's
    checkpoint alignment."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    impl = build(layer)
    mine = [(g.layer_names, g.kv_cache_spec) for g in impl.kv_cache_config.kv_cache_groups]
    theirs = [(g.layer_names, g.kv_cache_spec) for g in get_kv_cache_groups(impl.vllm_config, layer_specs(impl.opts))]
    assert mine == theirs


@pytest.mark.parametrize("layer, first_alignment", [("mamba2+kda", 1), ("kda+mamba2", 16)])
def test_the_scheduler_takes_the_first_mamba_groups_alignment(layer, first_alignment):
    impl = build(layer)
    groups = impl.runner.groups
    assert groups == Groups.of(impl.kv_cache_config) and len(groups.shadow) == 1
    names = [g.layer_names[0] for g in impl.kv_cache_config.kv_cache_groups]
    assert names[groups.mamba] == "kda.0" and names[1] == f"{MIXED_LAYERS[layer][0]}.0"
    assert impl.scheduler.mamba_prefill_checkpoint_alignment == first_alignment


def _first_request(impl: VllmCache) -> tuple[list[tuple[int, int]], set[int]]:
    """Runs PROMPT alone: its chunks, and the token counts of KDA's cached states."""
    impl.add_request(Request("a", PROMPT, 1))
    chunks = []
    for _ in range(8):
        plan = impl.schedule(64)
        if not plan.requests:
            break
        chunks += [(r.start, r.end) for r in plan.requests]
        impl.update(plan, StepResult(sampled={r.request_id: 1 for r in plan.requests if r.end >= len(PROMPT)}))
    return chunks, {len(s.tokens) for s in impl.view().cached_states}


@needs_033
def test_kda_second_loses_its_prompt_checkpoint_and_kda_first_keeps_it():
    """The finding kda-first-group-alignment (docs/findings/kda-first-group-alignment.md): with
    MambaMixer2's group first the scheduler prefills through the checkpoint at 24 (alignment 1), KDA's
    manager declines a checkpoint it cannot export (alignment 16), and KDA caches no state there; with
    KDA's group first (or alone) the chunk stops at 24 and the state is cached."""
    chunks, kda_states = _first_request(build("mamba2+kda"))
    assert chunks == [(0, 25)] and 24 not in kda_states
    for layer in ("kda+mamba2", "kda"):
        chunks, kda_states = _first_request(build(layer))
        assert chunks == [(0, 24), (24, 25)] and 24 in kda_states, layer


def test_reverted_53212_is_caught_by_a_generic_sequence(model, oracle):
    """vllm#53212 reverted (fault_injection/vllm_mutants.py): KDA's manager hashes a checkpoint block its
    worker never writes; the next request sharing the prefix is judged from memory."""
    ops = [Submit("a", PROMPT, 1), Drain(64), Submit("b", PROMPT + (9, 9, 9), 2), Drain(64)]
    apply_all(session_of(build("mamba2+kda"), model, oracle), ops)  # unmutated: passes
    s = session_of(VLLM_MUTANTS["vllm-kda-checkpoint-unaligned"](build("mamba2+kda")), model, oracle)
    with pytest.raises(ConformanceFailure) as caught:
        apply_all(s, ops)
    assert caught.value.kind in ("invariant", "logits")
