"""A correct cache is never red for its design (issue 34, item 3): the radix
tree of ``tests/radix_cache.py`` (a state evicted with its KV, checkpoints
copied out and skipped when no slot is free, and under ``PromptEndRadixCache``
the state at prompt ends only) passes the checks its design once failed,
and the excuses say what went unchecked."""

from __future__ import annotations

import pytest
from radix_cache import PagedRadixCache, PromptEndRadixCache, RadixCache

from conformance.contract import ImplConfig
from conformance.generate.budget import pool_limits
from conformance.judge.coverage import chances_short, design_waivers
from conformance.suite.checks import get_check
from conformance.suite.options import RunOptions
from conformance.suite.single import run_single_check


def _run(impl, check, seed=0, **pools):
    return run_single_check(impl, check, RunOptions(examples=25, steps=12, seed=seed, write_reports=False, **pools))


def _passed(res):
    assert res.status == "passed", (res.failure.kind, res.failure.message) if res.failure else res.reason


def test_a_state_evicted_with_its_kv_passes_kv_scarce_by_observation():
    """Finding a: 'state_outlives_kv stayed at 0 over 25 examples' at every
    seed; the design never lets a state outlive its KV, and memory shows it
    had the chances."""
    res = _run(RadixCache, "kv-scarce")
    _passed(res)
    assert res.coverage["state_outlives_kv"] == 0 and res.coverage["states_gone_with_kv"] >= 5
    assert any(n.startswith("state_outlives_kv stayed at 0, observed:") for n in res.notes)


def test_whole_block_hits_pass_mid_block_hits_with_the_hit_unchecked():
    res = _run(RadixCache, "mid-block-hits")
    _passed(res)
    assert res.coverage["mid_block_hits"] == 0 and res.coverage["mid_block_reuse_held"] >= 5
    assert any(n.startswith("aborts_before_copied_block_complete stayed at 0") for n in res.notes)


def test_prompt_end_retention_builds_a_to_b_to_a():
    """Finding b: under interval 0 the state at a prompt's end cannot serve
    the same prompt, and aba_displaced stayed at 0 at seeds 0, 4 and 5; the
    rule asks for the prompt's next turn."""
    res = _run(PromptEndRadixCache, "hard-prefixes")
    _passed(res)
    assert res.coverage["aba_displaced"] > 0 and res.coverage["aba_rerequests"] > 0


def test_a_cache_that_skips_a_checkpoint_when_no_slot_is_free_passes_the_hit_rate():
    """Finding d (`--check retention-hit-rate --state-slots 3`): the room
    counted a finishing request's running slot and the step's copy source."""
    _passed(_run(RadixCache, "retention-hit-rate", num_state_slots=3))


@pytest.mark.parametrize(("check", "chances"), [("mid-block-hits", "short_chunks_rounded_up"),
                                                ("chunked-prefill", "chunked_prefills")])
def test_chunks_rounded_up_to_a_block_pass_the_chunked_situations(check, chances):
    """SGLang's pages of 4: a chunk never ends inside a block, and one after
    a hit is shorter than the conv window only where the prompt ends there
    (short_chunks_from_snapshot stayed at 0 at seed 0, hidden behind its
    expected mid-block failure); memory counts the chances it did not take."""
    res = _run(PagedRadixCache, check)
    _passed(res)
    assert res.coverage["mid_block_chunk_ends"] == 0 and res.coverage[chances] >= 5


def test_observation_needs_its_chances_and_says_how_many_it_had():
    required = ("state_outlives_kv",)
    excused, _ = design_waivers(required, {"state_outlives_kv": 0, "states_gone_with_kv": 4}, None)
    assert not excused
    assert "this run had 4" in chances_short(required, {"states_gone_with_kv": 4}, excused)[0]
    excused, _ = design_waivers(required, {"state_outlives_kv": 0, "states_gone_with_kv": 5}, None)
    assert "observed" in excused["state_outlives_kv"]
    # a counter that occurred is asked for, whatever the design
    assert not design_waivers(required, {"state_outlives_kv": 1, "states_gone_with_kv": 9}, None)[0]


def test_a_declaration_excuses_and_is_held_to():
    required = ("snapshots_after_verify",)
    prompt_ends = {"interval": 0, "sequence_ends": False}
    assert design_waivers(required, {}, prompt_ends)[0]
    assert not design_waivers(required, {}, {**prompt_ends, "sequence_ends": True})[0]
    excused, contradicted = design_waivers(required, {"snapshots_after_verify": 2}, prompt_ends)
    assert not excused and "yet 2 states" in contradicted[0]


@pytest.mark.parametrize(("slots", "blocks", "excused", "skip"), [
    (3, 32, {"same_step_cold_prefills"}, False),  # finding c: one request at a time
    (4, 32, set(), False),
    (24, 2, set(), True),  # no request past its first block fits
])
def test_a_pool_too_small_for_a_history_is_said_not_failed(slots, blocks, excused, skip):
    spec = get_check("hard-prefixes")
    limits = pool_limits(spec, ImplConfig(block_size=4, num_kv_blocks=blocks, num_state_slots=slots))
    assert set(limits.excused) == excused and bool(limits.skip) == skip
