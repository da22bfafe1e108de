"""Speculative decoding in the contract and the harness (issue 22): the
harness proposes drafts, the runner verifies them on memory, the oracle
decides acceptance, and a step that breaks the rules is a contract failure.
Old adapters and repro files are unchanged."""

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig, RequestStep, Speculation, StepPlan, StepResult
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Draft, Drain, Step, Submit, op_from_dict, op_to_dict
from conformance.harness.speculation import accepted_length, draft_tokens
from conformance.judge import judged_session

SPEC = ImplConfig(block_size=4, num_kv_blocks=48, num_state_slots=24, options={"spec_tokens": 3})
PROMPT = tuple(range(1, 11))


def spec_session(model, oracle, factory=ReferenceCache, config=SPEC):
    return judged_session(factory, config, model, oracle, timeout=10.0)


def to_decode(s, rid="a", max_new=8, prompt=PROMPT):
    s.apply(Submit(rid, prompt, max_new))
    while not s.speculator.ready(s.tracks[rid]):
        s.apply(Step(1024))


@pytest.mark.parametrize("count,agree", [(3, 0), (3, 1), (3, 2), (3, 3), (2, 5), (1, 0)])
def test_draft_tokens_are_accepted_exactly_as_far_as_they_agree(model, oracle, count, agree):
    seq = PROMPT
    drafts = draft_tokens(oracle, seq, count, min(agree, count), model.config.vocab_size)
    assert len(drafts) == count
    assert accepted_length(oracle, seq, drafts) == min(agree, count)


@pytest.mark.parametrize("scheme", ["per-position", "rollback"])
def test_a_verification_step_is_computed_judged_and_accepted_by_the_oracle(model, oracle, scheme):
    config = ImplConfig(4, 48, 24, {"spec_tokens": 3, "spec_scheme": scheme})
    s = spec_session(model, oracle, config=config)
    assert s.speculator.declared == Speculation(3, scheme)
    to_decode(s)
    before = s.tracks["a"].tokens
    s.apply(Draft("a", 3, 2))
    s.apply(Step(1024))
    v = s.speculator.last["a"]
    assert v.base == before and v.accepted == 2 and len(v.drafts) == 3
    t = s.tracks["a"]
    # two accepted drafts and the token after them (the reference's greedy choice)
    assert t.tokens[: len(before) + 2] == before + v.drafts[:2] and len(t.tokens) == len(before) + 3
    assert t.computed == len(before) + 2
    verdicts = [e for e in s.history.as_data() if e["event"] == "verdict"]
    assert verdicts[-1]["end"] - verdicts[-1]["start"] == 1 and verdicts[-1]["ok"]
    s.apply(Drain(1024))  # the continuation is judged by logits: it resumes from the accepted state
    assert not s.active()
    assert [e["accepted"] for e in s.history.as_data() if e["event"] == "verified"] == [2]


@pytest.mark.parametrize("scheme", ["per-position", "rollback"])
@pytest.mark.parametrize("agree,kept", [(3, 2), (2, 2), (1, 1), (0, 0)])
def test_drafts_run_past_the_last_token_and_the_request_ends_inside_the_verification(model, oracle, scheme, agree,
                                                                                    kept):
    """Capped by the declaration only, as engines draft (issue 37, c): with
    two tokens left a request is proposed three drafts.  The sequence keeps at
    most the two: accepted drafts that reach them end it with no token sampled
    after them (update() reports it finished); one accepted ends it with the
    sampled token after it; none leaves one token to go.  Discarded drafts,
    rejected or past the end, are judged as rejected ones are (what the cache
    registers at the sequence's end is held to memory)."""
    config = ImplConfig(4, 48, 24, options={"spec_tokens": 3, "spec_scheme": scheme})
    s = spec_session(model, oracle, config=config)
    to_decode(s, max_new=3)  # one generated, two to go
    s.apply(Draft("a", 3, agree))
    assert len(s.speculator.proposals["a"]) == 3
    s.apply(Step(1024))
    v = s.history.verified_this_step()["a"]
    assert v.accepted == kept and len(v.drafts) == 3
    assert s.tracks["a"].done == (kept >= 1)
    s.apply(Drain(1024))
    assert s.tracks["a"].generated == 3 and len(s.tracks["a"].tokens) == len(PROMPT) + 3
    assert not s.active()


def test_drafts_for_a_request_not_in_decode_do_nothing(model, oracle):
    s = spec_session(model, oracle)
    s.apply(Submit("a", PROMPT, 4))
    s.apply(Draft("a", 2, 2))  # still prefilling
    assert "a" not in s.speculator.proposals


def test_an_implementation_without_speculation_is_never_proposed_drafts(model, oracle):
    s = spec_session(model, oracle, config=ImplConfig(4, 48, 24))
    assert s.speculator.declared is None
    s.apply(Submit("a", PROMPT, 4))
    s.apply(Step(1024))
    s.apply(Step(1024))
    s.apply(Step(1024))
    s.apply(Draft("a", 2, 2))
    assert not s.speculator.proposals
    s.apply(Drain(1024))


def test_draft_op_round_trips_and_old_ops_are_unchanged():
    op = Draft("r1", 3, 1)
    assert op_from_dict(op_to_dict(op)) == op
    assert op_to_dict(Step(4)) == {"op": "step", "budget": 4}
    with pytest.raises(ValueError, match="count"):
        op_from_dict({"op": "draft", "request_id": "r1", "count": -1})


def test_old_steps_and_results_carry_no_speculation():
    rs = RequestStep("a", 0, 4, (0,), 0)
    assert rs.drafts == () and rs.draft_slots == ()
    assert StepResult().accepted == {}
    with pytest.raises(ValueError):
        Speculation(0)
    with pytest.raises(ValueError):
        Speculation(2, "trim")  # type: ignore[arg-type]


class _Breaks(ReferenceCache):
    """The reference, breaking the speculative contract one named way."""

    how = ""

    def schedule(self, budget):
        plan = super().schedule(budget)
        out = []
        for rs in plan.requests:
            if self.how == "unproposed" and rs.drafts:
                from dataclasses import replace

                rs = replace(rs, drafts=tuple((d + 1) % 64 for d in rs.drafts))
            elif self.how == "aliased" and rs.drafts:
                from dataclasses import replace

                rs = replace(rs, draft_slots=(rs.state_slot,) + rs.draft_slots[1:])
            elif self.how == "short-slots" and rs.drafts and len(rs.drafts) > 1:
                from dataclasses import replace

                rs = replace(rs, draft_slots=rs.draft_slots[:1])
            out.append(rs)
        return StepPlan(tuple(out), plan.kv_copies, plan.state_copies, plan.transfers)


@pytest.mark.parametrize("how,message", [("unproposed", "not a prefix of the drafts proposed"),
                                         ("aliased", "must be distinct"),
                                         ("short-slots", "one per draft")])
def test_breaking_the_speculative_contract_is_a_contract_failure(model, oracle, how, message):
    factory = type(f"Breaks[{how}]", (_Breaks,), {"how": how})
    s = spec_session(model, oracle, factory=factory)
    with pytest.raises(ConformanceFailure) as exc:
        to_decode(s)
        s.apply(Draft("a", 3, 3))
        s.apply(Step(1024))
    assert exc.value.kind == "contract" and message in str(exc.value)


def test_a_rejected_drafts_kv_stays_in_memory_with_its_provenance(model, oracle):
    """Memory records what was computed: the KV of a rejected draft (the next
    step overwrites it), never believed to be the sequence's."""
    s = spec_session(model, oracle)
    to_decode(s)
    s.apply(Draft("a", 3, 0))
    s.apply(Step(1024))
    v = s.speculator.last["a"]
    plan = s.last_plan.requests[0]
    assert plan.drafts == v.drafts and len(plan.draft_slots) == 3
    B = 4
    pos = v.end  # the first (rejected) draft
    assert s.memory.kv_prov[plan.block_table[pos // B]][pos % B] == v.base + v.drafts[:1]
    assert s.tracks["a"].tokens[: pos + 1] != v.base + v.drafts[:1]
    # each verified position's state in its own slot
    assert s.memory.state_holds(plan.draft_slots[0]) == (v.base + v.drafts[:1],) * 2
    assert s.memory.state_holds(plan.state_slot) == (v.base,) * 2


class _SnapshotsADraft(ReferenceCache):
    """Asks for a snapshot of the state after the second draft into a spare slot."""

    def schedule(self, budget):
        from dataclasses import replace

        plan = super().schedule(budget)
        steps = tuple(replace(rs, snapshots=rs.snapshots + ((rs.end + 2, 22),)) if len(rs.drafts) >= 2 else rs
                      for rs in plan.requests)
        return StepPlan(steps, plan.kv_copies, plan.state_copies, plan.transfers)


@pytest.mark.parametrize("agree,taken", [(2, True), (1, False)])
def test_a_snapshot_at_a_draft_position_is_taken_only_where_the_verifier_accepts(model, oracle, agree, taken):
    """As an engine copies the accepted column after verification (vLLM's
    postprocess_mamba): a snapshot past a rejected draft is never taken."""
    s = spec_session(model, oracle, factory=_SnapshotsADraft)
    to_decode(s)
    s.apply(Draft("a", 3, agree))
    s.apply(Step(1024))
    v = s.speculator.last["a"]
    held = s.memory.state_holds(22)
    assert (held == (v.base + v.drafts[:2],) * 2) is taken
