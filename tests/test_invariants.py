"""The structural invariants: what the implementation states against what
memory holds."""

from conformance.contract import CachedKV, CachedState, CacheView, Layout, RequestStep, StepPlan
from conformance.harness.memory import Memory
from conformance.judge.invariants import check_tables_referenced, check_view
from conformance.model import ModelConfig

LAYOUT = Layout(block_size=4, num_kv_blocks=4, num_state_slots=2)


def _memory():
    mem = Memory(LAYOUT, ModelConfig())
    mem.kv_prov[1] = [(7,), (7, 8), (7, 8, 9), None]
    mem.conv_prov[0] = mem.ssm_prov[0] = (7, 8, 9)
    return mem


def test_an_honest_view_has_no_problems():
    view = CacheView(kv_refcounts={1: 1}, state_refcounts={0: 0}, cached_kv=(CachedKV(1, (7, 8, 9)),),
                     cached_states=(CachedState(0, (7, 8, 9)),))
    assert check_view(view, _memory(), idle=False) == []


def test_cached_entries_must_hold_what_they_are_registered_for():
    view = CacheView(cached_kv=(CachedKV(1, (7, 8, 9, 10)),), cached_states=(CachedState(0, (7, 8)),))
    problems = check_view(view, _memory(), idle=False)
    assert any("KV block 1" in p and "never-written" in p for p in problems)
    assert any("state slot 0" in p and "written after the prefix ended" in p for p in problems)


def test_refcounts_are_bounded_non_negative_and_zero_at_idle():
    view = CacheView(kv_refcounts={9: 1, 2: -1, 1: 2})
    problems = check_view(view, _memory(), idle=True)
    assert any("outside the layout" in p for p in problems)
    assert any("refcount -1" in p for p in problems)
    assert any("leaked" in p for p in problems)


def test_a_scheduled_table_must_be_referenced():
    plan = StepPlan((RequestStep("a", 0, 6, (1, 3), 0),))
    assert check_tables_referenced(CacheView(kv_refcounts={1: 1, 3: 1}), plan, 4) == []
    problems = check_tables_referenced(CacheView(kv_refcounts={1: 1, 3: 0}), plan, 4)
    assert problems and "KV block 3" in problems[0]
