"""A plan whose requests contend for memory is a contract error at schedule()
time (issue 21, h): two requests on one state slot, a slot one writes and
another reads, a snapshot into the request's own running slot, a KV position
written by one request and read (or written for another sequence) by another.
Before, the first was caught by logits only if one of the requests resumed."""

from dataclasses import replace

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import FRESH, RESUME, ImplConfig, RequestStep, StepPlan, copy_from
from conformance.errors import ConformanceFailure
from conformance.harness.conflicts import plan_conflicts
from conformance.harness.ops import Drain, Submit
from conformance.judge import judged_session

B = 4
A_TOKENS, B_TOKENS = tuple(range(1, 11)), tuple(range(20, 30))
TOKENS = {"a": A_TOKENS, "b": B_TOKENS}


def step(rid, start, end, table, slot, init=FRESH, snapshots=()):
    return RequestStep(rid, start, end, tuple(table), slot, init, tuple(snapshots))


class SharesOneSlot(ReferenceCache):
    """Schedules the second request of a step on the first one's running slot
    (both cold, both finish in that step: no later step reads the slot)."""

    def schedule(self, budget):
        plan = super().schedule(budget)
        if len(plan.requests) < 2:
            return plan
        first, second = plan.requests[:2]
        return replace(plan, requests=(first, replace(second, state_slot=first.state_slot), *plan.requests[2:]))


def test_two_requests_on_one_state_slot_fail_at_schedule_time(model, oracle):
    s = judged_session(SharesOneSlot, ImplConfig(block_size=B, num_kv_blocks=32, num_state_slots=16), model, oracle)
    s.apply(Submit("a", A_TOKENS, 1))
    s.apply(Submit("b", B_TOKENS, 1))
    with pytest.raises(ConformanceFailure, match=r"state slot \d+ is written by two requests of one step: "
                                                 r"r?a \(running slot\) and r?b \(running slot\)") as exc:
        s.apply(Drain(1024))
    assert exc.value.kind == "contract"
    assert not any(e["event"] == "verdict" for e in s.history.as_data())  # nothing ran


@pytest.mark.parametrize("plan,message", [
    (StepPlan((step("a", 0, 8, [0, 1], 0), step("b", 0, 8, [2, 3], 1, snapshots=[(4, 0)]))),
     "state slot 0 is written by two requests of one step: a (running slot) and b (snapshot target at 4)"),
    (StepPlan((step("a", 0, 8, [0, 1], 0), step("b", 4, 8, [0, 3], 1, copy_from(0)))),
     "state slot 0 is a's running slot and b's copy source in one step"),
    (StepPlan((step("a", 4, 8, [0, 1], 0, RESUME), step("b", 0, 8, [2, 3], 1, snapshots=[(4, 0)]))),
     "state slot 0 is b's snapshot target at 4 and a's resumed slot in one step"),
    (StepPlan((step("a", 0, 8, [0, 1], 0, snapshots=[(4, 0)]),)),
     "a snapshots position 4 into its own running slot 0, which ends the step holding the state at 8"),
    (StepPlan((step("a", 4, 8, [0, 1], 0, RESUME), step("b", 6, 8, [0, 1], 1, copy_from(2)))),
     "KV block 1 offset 0 is written by a (position 4) and read by b (position 4, part of its reused prefix)"),
    (StepPlan((step("a", 0, 8, [0, 1], 0), step("b", 0, 8, [2, 1], 1))),
     "KV block 1 offset 0 is written by two requests of one step for different sequences: a (position 4) "
     "and b (position 4)"),
])
def test_contended_memory_is_named(plan, message):
    problems = plan_conflicts(plan, B, TOKENS)
    assert any(p.startswith(message) for p in problems), problems


def test_what_no_order_changes_is_allowed():
    same = {"a": A_TOKENS, "c": A_TOKENS}
    ok = [
        # one cold prefix computed twice into shared blocks: the same bytes
        StepPlan((step("a", 0, 8, [0, 1], 0), step("c", 0, 8, [0, 1], 1))),
        # two requests copying from one snapshot; a snapshot at the step's end into the running slot
        StepPlan((step("a", 4, 8, [0, 1], 0, copy_from(5), [(8, 0)]), step("c", 4, 6, [0, 2], 1, copy_from(5)))),
        # reading offsets of a block another request writes at other offsets
        StepPlan((step("a", 2, 4, [0], 0, RESUME), step("c", 2, 3, [0], 1, copy_from(5)))),
    ]
    assert [plan_conflicts(p, B, same) for p in ok] == [[], [], []]


def drafting(rid, start, end, table, slot, drafts, draft_slots=(), init=RESUME):
    return replace(step(rid, start, end, table, slot, init), drafts=tuple(drafts), draft_slots=tuple(draft_slots))


@pytest.mark.parametrize("plan,message", [
    # a draft slot is written like a running slot
    (StepPlan((drafting("a", 7, 8, [0, 1, 2], 0, [5, 6], [3, 4]), step("b", 0, 8, [5, 6], 4))),
     "state slot 4 is written by two requests of one step: a (draft slot 1) and b (running slot)"),
    # the drafts' KV positions are written: here for another sequence than b's
    (StepPlan((drafting("a", 7, 8, [0, 1, 2], 0, [5, 6, 7, 8]), step("b", 8, 12, [3, 4, 2], 1, RESUME))),
     "KV block 2 offset 0 is written by two requests of one step for different sequences: a (position 8) "
     "and b (position 8)"),
])
def test_a_verifications_drafts_are_memory_it_writes(plan, message):
    # both rules were blind past ``end`` before the merge with speculative decoding
    tokens = {"a": A_TOKENS[:8], "b": B_TOKENS[:8]}
    problems = plan_conflicts(plan, B, tokens)
    assert any(p.startswith(message) for p in problems), problems


def test_two_verifications_of_one_sequence_write_the_same_bytes():
    tokens = {"a": A_TOKENS[:8], "c": A_TOKENS[:8]}
    plan = StepPlan((drafting("a", 7, 8, [0, 1, 2], 0, [5, 6], [2, 3]),
                     drafting("c", 7, 8, [0, 1, 2], 1, [5, 6], [4, 5])))
    assert plan_conflicts(plan, B, tokens) == []


def test_a_hit_on_what_an_earlier_request_of_the_step_writes_for_the_same_sequence():
    """vLLM hashes full-attention blocks when it allocates them, so a request of a step may hit a block
    another request of that step is computing (a model without recurrent layers: MambaManager refuses
    such a hit); an engine's batch writes a layer's KV for every request before any reads it.  Allowed
    when the writer comes first in the plan (the runner's order) and writes the very position read."""
    same = {"a": A_TOKENS, "c": A_TOKENS}
    writer_first = StepPlan((step("a", 4, 8, [0, 1], 0, RESUME), step("c", 6, 8, [0, 1], 1, copy_from(5))))
    assert plan_conflicts(writer_first, B, same) == []
    reader_first = StepPlan(tuple(reversed(writer_first.requests)))
    assert any("part of its reused prefix" in p for p in plan_conflicts(reader_first, B, same))
    assert any("part of its reused prefix" in p for p in plan_conflicts(writer_first, B, TOKENS | {"c": B_TOKENS}))
