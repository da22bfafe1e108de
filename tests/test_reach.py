"""The histories of issue 37: each rule builds its history whole in one draw
and its counter counts it (from memory and the harness's records); each
witness cache (``tests/reach_witnesses.py``: the reference with one bug an
outside cache had) is caught by that history; a correct cache that lists at
``schedule()`` what its step writes, as vLLM does, is not refused by the
judgement of that view; the drafter proposes past a request's last token."""

from __future__ import annotations

import pytest
from reach_witnesses import CAUGHT_BY, WITNESSES

from conformance.adapters.reference import ReferenceCache
from conformance.adapters.reference.block_pool import ROOT, chain
from conformance.errors import ConformanceFailure
from conformance.suite.run import RunOptions
from conformance.suite.single import run_single_check

REST = (5, 9, 13, 17, 21)

# history -> (check, the rule's call, the counter it reaches)
HISTORIES = {
    "a": ("pressure-while-running", lambda m: m.evict_past_running_entry(7, 2, 0, True), "evictions_past_live_hit"),
    "b": ("retention-policy", lambda m: m.reconverge(3, 1, 1), "reconverged_blocks"),
    "c": ("spec-decode", lambda m: m.verify_at_the_edges(0, 2, 1, 0, 0), "ends_in_verification"),
    "d": ("spec-decode", lambda m: m.verify_at_the_edges(0, 2, 1, 0, 0), "rejected_drafts_opened_block"),
    "e": ("spec-decode", lambda m: m.verify_at_the_edges(0, 2, 1, 0, 0), "aborts_after_verify"),
    "f": ("spec-decode", lambda m: m.verify_at_the_edges(0, 2, 1, 0, 0), "admissions_beside_verify"),
    "g": ("kv-scarce", lambda m: m.wait_while_busy(11), "waits_while_busy"),
    "h": ("mid-block-hits", lambda m: m.abort_before_copy_complete(0, 1, 1, REST, 1),
          "aborts_after_copy_before_first_step"),
}


def _machine(machine, check, factory):
    return machine(check, factory, spec_tokens=3) if check == "spec-decode" else machine(check, factory)


@pytest.mark.parametrize("letter", sorted(HISTORIES))
def test_the_rule_builds_the_history_and_the_reference_passes_it(machine, letter):
    check, rule, counter = HISTORIES[letter]
    m = _machine(machine, check, ReferenceCache)
    rule(m)
    assert m.session.coverage[counter] >= 1, m.session.coverage


@pytest.mark.parametrize("letter", sorted(HISTORIES))
def test_the_history_catches_its_witness(machine, letter):
    check, rule, _ = HISTORIES[letter]
    m = _machine(machine, check, WITNESSES[letter])
    with pytest.raises(ConformanceFailure) as exc:
        rule(m)
    assert exc.value.kind != "coverage"


def test_the_spec_edges_meet_a_count_below_the_declared_one_and_drafts_past_the_end(machine):
    m = _machine(machine, "spec-decode", ReferenceCache)
    m.verify_at_the_edges(0, 2, 1, 1, 3)  # two drafts of three; at the end, three accepted past it
    cov = m.session.coverage
    assert cov["verify_below_declared"] >= 1 and cov["drafts_past_remaining"] >= 1 and cov["ends_in_verification"]


class ListsItsStepAtSchedule(ReferenceCache):
    """Correct: lists at ``schedule()`` the full blocks its step completes,
    by the request's known tokens only (vLLM's ``allocate_slots`` caches
    them before the forward pass), never a draft's position."""

    def _plan_request(self, req, budget):
        step = super()._plan_request(req, budget)
        if step is not None:
            B, parent = self.B, ROOT
            for i in range(step.end // B):
                tokens = tuple(req.tokens[i * B: (i + 1) * B])
                if i >= step.start // B and req.blocks[i] not in self.kv.meta:
                    self.kv.register(parent, tokens, tuple(req.tokens[: (i + 1) * B]), req.blocks[i])
                parent = chain(parent, tokens)
        return step


@pytest.mark.parametrize("check", ["spec-decode", "chunked-prefill"])
def test_a_cache_that_lists_its_step_at_schedule_by_known_tokens_passes(check):
    """The judgement of the view right after ``schedule()`` refuses a
    listing through a draft the verifier did not keep and content the step
    did not leave there; a listing of what the step computes from known
    tokens is a correct design's."""
    options = {"spec_tokens": 3} if check == "spec-decode" else {}
    res = run_single_check(ListsItsStepAtSchedule, check, RunOptions(seed=0, examples=8, impl_options=options,
                                                                     write_reports=False))
    assert res.status == "passed", res.failure


class FirstChunkToBlockEnd(WITNESSES["h"]):
    """Correct: witness h's design without its leak (a hit's first chunk runs
    to the end of the block it copied, whatever the budget)."""

    def abort(self, request_id):
        ReferenceCache.abort(self, request_id)


def test_a_design_whose_hit_chunk_runs_to_the_block_end_is_not_red_for_it():
    """Its copy is incomplete only before that chunk: the abort there is the
    history (h), and the chunk that stops inside the block it never makes is
    excused by observation (before: a coverage failure at every seed)."""
    res = run_single_check(FirstChunkToBlockEnd, "mid-block-hits", RunOptions(seed=0, write_reports=False))
    assert res.status == "passed", res.failure
    assert res.coverage["aborts_after_copy_before_first_step"] > 0
    assert any("hit_chunks_to_block_end" in n for n in res.notes), res.notes


@pytest.mark.slow
@pytest.mark.parametrize("letter", sorted(WITNESSES))
def test_the_quick_profile_catches_each_witness(letter):
    """As the quick profile runs the check whose history catches it (its
    seed, its examples): the catch is the general suite's."""
    res = run_single_check(WITNESSES[letter], CAUGHT_BY[letter], RunOptions(seed=0, write_reports=False))
    assert res.status == "failed" and res.failure.kind != "coverage", res.failure


def test_the_turn_over_hands_a_finished_requests_blocks_to_the_next_step(machine):
    """The ``turn-over`` history (generate/rules/turnover.py): a finished request's blocks are written by
    the step right after, and the reference, whose tier copies a block before it is overwritten, passes
    it with its host listings judged against the store."""
    m = machine("tier-races", ReferenceCache)
    m.finish_then_turn_over(1, 0)  # a cold pool: the reference's never-used blocks go first
    m.built.discard("turn-over")
    m.finish_then_turn_over(0, 1)
    cov = m.session.coverage
    assert cov["finished_blocks_retaken"] >= 1, cov


def test_a_rule_after_a_known_defect_ended_the_example_ends_quietly(machine):
    """Once a known defect ended an example nothing more is applied, and the rule that tries ends there
    (configured.ExampleStopped), rather than reading tracks of requests its Submits never made: the
    KeyError that tier-races[connector=divergent] raised as a harness error at seed 0."""
    m = machine("tier-races", ReferenceCache)
    m.stopped = True
    before = len(m.ops)
    assert m.finish_then_turn_over(0, 0) is None
    assert len(m.ops) == before
