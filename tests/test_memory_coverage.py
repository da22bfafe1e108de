"""The hard histories measured from memory and provenance
(conformance/judge/memory_coverage.py): each counter counts its history, and
not the history next to it; the targeted rules (conformance/generate/rules/
targeted.py) build theirs in one draw; the mutants of those histories are
caught there by the general checkers."""

import random

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Abort, Drain, Step, Submit
from conformance.judge import judged_session

B = 4


@pytest.fixture
def tokens():
    rng = random.Random(1)
    return lambda n: tuple(rng.randrange(64) for _ in range(n))


def session(model, oracle, factory=ReferenceCache, **sizes):
    return judged_session(factory, ImplConfig(block_size=B, **sizes), model, oracle, timeout=10)


def apply(s, *ops):
    for op in ops:
        s.apply(op)


def decoding_then_young(s, tokens, old_junk: bool):
    """A request decodes with its prompt published; a younger prompt runs to its
    end beside it (or, with ``old_junk``, an older one ran before it); then a
    long prompt needs more blocks than the never-used ones."""
    if old_junk:
        apply(s, Submit("j", tokens(11), 1), Drain(1024))
    apply(s, Submit("a", tokens(5), 16), Step(1024), Step(1024))
    if not old_junk:
        apply(s, Submit("y", tokens(11), 1), Step(1024), Step(1024), Step(1024))
        assert s.tracks["y"].done
    apply(s, Submit("b", tokens(15 if not old_junk else 11), 1), *[Step(1024)] * 4)


def test_an_eviction_past_a_decoding_requests_entry_is_counted(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=8, num_state_slots=8)
    decoding_then_young(s, tokens, old_junk=False)
    assert s.coverage["evictions_past_running_entry"] == 1
    assert s.coverage["cached_overwritten_while_running"] >= 1


def test_an_eviction_of_older_entries_only_is_not(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=8, num_state_slots=8)
    decoding_then_young(s, tokens, old_junk=True)
    assert s.coverage["cached_overwritten_while_running"] >= 1  # it evicted while "a" decoded...
    assert s.coverage["evictions_past_running_entry"] == 0  # ...but only what was older than a's entries


def test_a_cache_that_evicts_the_running_entry_fails_there(model, oracle, tokens):
    from fault_injection.catalog import get_mutant

    s = session(model, oracle, get_mutant("evict-running-entry").wrap(ReferenceCache), num_kv_blocks=8,
                num_state_slots=8)
    with pytest.raises(ConformanceFailure) as info:
        decoding_then_young(s, tokens, old_junk=False)
        apply(s, Step(1024), Step(1024))
    # contract: the plan reuses the evicted entry's block for another request in the same step
    # (harness/conflicts.py names it at schedule() time, before any logit can be wrong)
    assert info.value.kind in ("logits", "invariant", "contract")


def copied_then_aborted(s, tokens, budget: int):
    """A prompt ending 2 tokens into a block is cached; a longer one hits it,
    runs one ``budget`` step and is aborted."""
    p = tokens(6)
    apply(s, Submit("p", p, 1), Drain(1024), Submit("r", p + tokens(6), 1), Step(budget), Abort("r"))
    return p


def test_an_abort_before_the_copied_block_is_complete_is_counted(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=16, num_state_slots=8)
    copied_then_aborted(s, tokens, 1)  # computed 7 of the copied block's 8
    assert s.coverage["aborts_before_copied_block_complete"] == 1
    assert s.coverage["mid_block_chunks_after_mid_block_hit"] == 1  # [6, 7): starts and stops inside a block
    assert s.coverage["short_chunks_from_snapshot"] == 1


def test_an_abort_after_it_completed_the_copy_is_not(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=16, num_state_slots=8)
    copied_then_aborted(s, tokens, 1024)  # the reference's chunk ends at the block boundary: 8
    assert s.coverage["aborts_before_copied_block_complete"] == 0
    assert s.coverage["mid_block_chunks_after_mid_block_hit"] == 0


@pytest.mark.parametrize("name", ["abort-publishes-copied-block", "abort-leaks-copy"])
def test_the_abort_mutants_fail_there(model, oracle, tokens, name):
    from fault_injection.catalog import get_mutant

    s = session(model, oracle, get_mutant(name).wrap(ReferenceCache), num_kv_blocks=16, num_state_slots=8)
    with pytest.raises(ConformanceFailure) as info:
        copied_then_aborted(s, tokens, 1)
    assert info.value.kind == "invariant"


def test_a_prompt_asked_again_after_its_entries_were_overwritten_is_displaced(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=8, num_state_slots=4)
    p = tokens(6)
    apply(s, Submit("p", p, 1), Drain(1024), Submit("p2", p, 1), Drain(1024))
    assert s.coverage["aba_displaced"] == 0  # asked again at once: memory holds what it held
    apply(s, Submit("j", tokens(27), 1), Drain(1024), Submit("p3", p, 1), Drain(1024))
    assert s.coverage["aba_displaced"] == 1


def test_a_state_that_outlives_its_kv_is_counted(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=8, num_state_slots=16)
    p = tokens(8)
    apply(s, Submit("p", p, 1), Drain(1024), Submit("p2", p + (1,), 1), Drain(1024))
    assert s.coverage["state_outlives_kv"] == 0  # KV and state both held
    apply(s, Submit("j", tokens(27), 1), Drain(1024), Submit("p3", p + (1,), 1), Drain(1024))
    assert s.coverage["state_outlives_kv"] == 1  # the KV pool turned over, the state slots did not


# -- the targeted rules build their history in one draw ---------------------------------------------
# (the `machine` fixture is in conftest.py)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evict_running_builds_its_history_in_one_draw(machine, seed):
    m = machine("pressure-while-running")
    m.evict_past_running_entry(seed, 1, seed % B)
    assert m.session.coverage["evictions_past_running_entry"] >= 1
    assert m.session.tracks["r1"].done  # the decoding request was aborted at the end
    assert "evict-running" in m.built  # once an example


@pytest.mark.parametrize("offset", [1, 2])
def test_abort_copy_builds_its_history_in_one_draw(machine, offset):
    m = machine("mid-block-hits")
    m.abort_before_copy_complete(0, 1, offset, tuple(range(B + 1)), 2)
    cov = m.session.coverage
    assert cov["aborts_before_copied_block_complete"] == 1
    assert cov["mid_block_chunks_after_mid_block_hit"] == 2  # the aborted request and the next one
    assert not m.session.active()


def test_tier_tail_builds_its_history_in_one_draw(machine):
    m = machine("tier-reuse")
    m.remote_beats_local_tail(0, m.max_len - 1, 2, 2, 0)
    assert m.session.coverage["tier_hits_over_mid_block_local"] == 1
    assert m.session.coverage["tier_hits_over_local"] == 1


def test_a_divergence_inside_a_block_memory_holds_is_counted(model, oracle, tokens):
    s = session(model, oracle, num_kv_blocks=16, num_state_slots=8)
    p = tokens(8)
    apply(s, Submit("p", p, 1), Drain(1024))
    apply(s, Submit("q", p[:4] + (p[4] ^ 1,) + p[5:], 1), Drain(1024))  # parts at a block boundary
    assert s.coverage["divergences_inside_held_block"] == 0
    apply(s, Submit("r", p[:6] + (p[6] ^ 1, 9), 1), Drain(1024))  # parts 2 tokens into block 1
    assert s.coverage["divergences_inside_held_block"] == 1


def test_kv_first_builds_its_history_in_one_draw(machine):
    m = machine("kv-scarce")
    m.evict_kv_keep_state(0, 3, (1, 2))
    assert m.session.coverage["state_outlives_kv"] == 1
    assert m.session.coverage["state_outlives_held_kv"] == 0  # the reference frees a chain's head first


def test_kv_first_keeping_the_head_leaves_a_kv_prefix_below_the_state(machine):
    m = machine("kv-scarce")
    m.evict_kv_keep_state(0, 3, (1, 2), keep_head=True)
    assert m.session.coverage["state_outlives_held_kv"] == 1
