"""Per-layer window groups (Layout.window_layer_groups): a cache may give each layer group of window layers
its own table, as vLLM does (``get_kv_cache_groups``: Gemma 3's five window layers of one window are five
groups).  Judged from memory as before: each window layer reads through its own group's table."""

from dataclasses import replace

import pytest
from drive import apply_all, session_of

from conformance.adapters.reference import ReferenceCache
from conformance.contract import CachedKV, ImplConfig, Layout
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Drain, Step, Submit
from conformance.harness.oracle import Oracle
from conformance.model import ModelConfig, TinyHybrid


class PerLayerGroups:
    """The reference, declaring one window group per W layer (vLLM's grouping of a model whose W layers
    share one window): each group's table is the reference's table of that window, so a page holds one
    sequence's positions for every group, and each cached window block is listed once per group.
    ``skew``: a buggy variant whose group ``skew`` reads through a table one block to the left."""

    def __init__(self, config: ImplConfig, skew: int | None = None):
        self.inner = ReferenceCache(config)
        self.layer_windows = tuple(w for w in config.layer_windows if w)
        self.of_group = {g: config.windows.index(w) for g, w in enumerate(self.layer_windows)}
        self.skew = skew

    def layout(self) -> Layout:
        return replace(self.inner.layout(), window_layer_groups=tuple((i,) for i in range(len(self.layer_windows))))

    def add_request(self, r):
        self.inner.add_request(r)

    def schedule(self, budget):
        plan = self.inner.schedule(budget)
        steps = []
        for rs in plan.requests:
            if rs.window_tables:
                tables = [rs.window_tables[self.of_group[g]] for g in range(len(self.layer_windows))]
                if self.skew is not None:
                    tables[self.skew] = tables[self.skew][1:] + (tables[self.skew][-1],)
                rs = replace(rs, window_tables=tuple(tables))
            steps.append(rs)
        return replace(plan, requests=tuple(steps))

    def update(self, plan, result):
        return self.inner.update(plan, result)

    def abort(self, rid):
        self.inner.abort(rid)

    def view(self):
        v = self.inner.view()
        kv = tuple(e for e in v.cached_kv if e.window_group is None) + tuple(
            CachedKV(e.block, e.tokens, g) for e in v.cached_kv if e.window_group is not None
            for g in range(len(self.layer_windows)) if self.of_group[g] == e.window_group)
        return replace(v, cached_kv=kv)


@pytest.fixture(scope="module")
def gemma():
    model = TinyHybrid(ModelConfig.fixture("window-5to1"))
    return model, Oracle(model)


def _config(model) -> ImplConfig:
    return ImplConfig(block_size=4, num_kv_blocks=64, num_state_slots=24, **model.config.window_facts())


def _ops():
    p = tuple((7 * i + 3) % 64 for i in range(23))
    return [Submit("a", p, 3), Step(5), Drain(64), Submit("b", p + (1, 2, 3), 2), Drain(64),
            Submit("c", p[:21], 2), Drain(64)]


def test_the_facts_a_cache_is_told_of_its_window_layers(gemma):
    model, _ = gemma
    config = _config(model)
    assert config.windows == (8,) and config.layer_kinds == "WWWWWA" and config.layer_windows == (8,) * 5 + (0,)
    assert ModelConfig().window_facts() == {}


def test_per_layer_groups_are_judged_like_the_default_grouping(gemma):
    model, oracle = gemma
    s = session_of(PerLayerGroups(_config(model)), model, oracle)
    assert s.memory.windows == (8,) * 5 and s.memory.layer_groups == (0, 1, 2, 3, 4)
    apply_all(s, _ops())


def test_one_group_reading_through_a_wrong_table_is_caught(gemma):
    model, oracle = gemma
    s = session_of(PerLayerGroups(_config(model), skew=3), model, oracle)
    with pytest.raises(ConformanceFailure) as caught:
        apply_all(s, _ops())
    assert caught.value.kind in ("invariant", "logits", "contract")


@pytest.mark.parametrize("groups", [((0, 1), (2,)), ((0,), (0,), (1, 2, 3, 4))])
def test_a_declaration_memory_cannot_hold_is_a_contract_failure(gemma, groups):
    model, oracle = gemma

    class Bad(PerLayerGroups):
        def layout(self):
            return replace(self.inner.layout(), window_layer_groups=groups)

    with pytest.raises(ConformanceFailure) as caught:
        session_of(Bad(_config(model)), model, oracle)
    assert caught.value.kind == "contract" and "not a partition" in str(caught.value)


def test_a_group_mixing_windows_is_refused():
    from conformance.errors import ContractError
    from conformance.harness.memory import declared_groups

    assert declared_groups(((1,), (0, 2)), (6, 11, 6)) == ((11, 6), (1, 0, 1))
    with pytest.raises(ContractError, match="mixes windows"):
        declared_groups(((0, 1),), (6, 11))
