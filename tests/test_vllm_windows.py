"""vLLM's sliding-window groups at the scheduler level (issue 35, item 5): the groups vLLM's own grouping makes
of the window models (window + Mamba + full, gpt-oss's alternating layers, Gemma 3's five local per global),
declared to the harness as per-layer window groups, and a history whose window blocks vLLM lets go, judged
from memory."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")

from drive import apply_all, session_of  # noqa: E402

from conformance.adapters.vllm import VllmCache  # noqa: E402
from conformance.contract import NULL_BLOCK, ImplConfig  # noqa: E402
from conformance.harness.ops import Drain, Step, Submit  # noqa: E402
from conformance.harness.oracle import Oracle  # noqa: E402
from conformance.model import ModelConfig, TinyHybrid  # noqa: E402

SHAPES = {"window-hybrid": (((0,), (1,)), True), "window-alternating": (((0, 1),), False),
          "window-5to1": (((0,), (1,), (2,), (3,), (4,)), False)}


def build(name: str, blocks: int = 96) -> VllmCache:
    model = ModelConfig.fixture(name)
    return VllmCache(ImplConfig(block_size=4, num_kv_blocks=blocks, num_state_slots=24, **model.window_facts()))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_window_groups_are_vllms_own(name):
    """One spec per layer, grouped by vLLM's get_kv_cache_groups; the window groups declared to the harness
    as its per-layer groups (Layout.window_layer_groups), a Mamba group only where the model has R layers."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    impl = build(name)
    groups, has_mamba = SHAPES[name]
    assert impl.layout().window_layer_groups == groups
    assert (impl.runner.groups.mamba is not None) == has_mamba
    windows = [g.kv_cache_spec.sliding_window for g in impl.kv_cache_config.kv_cache_groups
               if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    layer_windows = [w for w in ModelConfig.fixture(name).layer_windows if w]
    assert windows == [layer_windows[group[0]] for group in groups]


@pytest.mark.parametrize("name", ["window-hybrid", "window-alternating", "window-5to1"])
def test_vllm_lets_window_blocks_go_and_the_harness_judges_what_it_reads(name):
    """A prompt past every window prefilled in chunks, decoding, then its sequence again: vLLM nulls the
    blocks that left each window (NULL_BLOCK in the plan), and every logit and every window read is right."""
    model = TinyHybrid(ModelConfig.fixture(name))
    impl = build(name)
    s = session_of(impl, model, Oracle(model))
    p = tuple((5 * i + 2) % 64 for i in range(27))
    nulls = []
    original = impl.runner.to_plan

    def to_plan(so):
        plan = original(so)
        nulls.extend(NULL_BLOCK in t for rs in plan.requests for t in rs.window_tables)
        return plan

    impl.runner.to_plan = to_plan
    apply_all(s, [Submit("a", p, 6), Step(5), Step(7), Drain(64), Submit("b", p + (1, 2, 3), 2), Drain(64)])
    assert any(nulls), "vLLM let no window block go"
