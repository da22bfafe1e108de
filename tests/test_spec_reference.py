"""The reference's speculative decoding (issue 22) and the spec family: the
reference passes under both state schemes and with EAGLE's block drop; the
coverage counters count what happened (from the harness's records, not the
cache's word); only the accepted prefix may be cached; an implementation
without speculative decoding is skipped, not passed."""

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig, Speculation
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Abort, Draft, Drain, Step, Submit
from conformance.judge import judged_session
from conformance.judge.spec_decode import SPEC_COUNTERS
from conformance.suite.checks import PROFILES, get_check
from conformance.suite.run import RunOptions
from conformance.suite.single import run_single_check

PROMPT = tuple(range(3, 14))


def spec_session(model, oracle, factory=ReferenceCache, **options):
    config = ImplConfig(4, 48, 24, {"spec_tokens": 3, **options})
    return judged_session(factory, config, model, oracle, timeout=10.0)


def to_decode(s, rid, prompt=PROMPT, max_new=8):
    s.apply(Submit(rid, prompt, max_new))
    while not s.speculator.ready(s.tracks[rid]):
        s.apply(Step(1024))


def test_the_spec_check_is_in_every_profile_and_last():
    for profile in PROFILES.values():
        ids = [c.id for c in profile.checks]
        assert "spec-decode" in ids
    quick = [c.id for c in PROFILES["quick"].checks]
    # each family appended in turn (spec, then windows): the checks before it keep their seeds
    assert quick[quick.index("spec-decode"):] == ["spec-decode", "window-reuse", "window-spec"]
    spec = get_check("spec-decode")
    assert spec.family == "spec" and spec.spec
    assert set(spec.required) == set(SPEC_COUNTERS) - {"verify_steps"} | {"aborts_after_verify"}


@pytest.mark.parametrize("options", [{}, {"spec_scheme": "rollback"}, {"spec_drop_block": True}])
def test_the_reference_passes_the_spec_family(options):
    """As the quick profile runs it (seed 1), under each scheme, the block
    drop (judged by the expected-hit oracle, which knows it)."""
    res = run_single_check(ReferenceCache, "spec-decode", RunOptions(seed=1, impl_options=options,
                                                                     write_reports=False))
    # Under the block drop a hit past accepted drafts needs the sequence to run on a block
    # further: before the spec-walk rule, seed 1 met none (hits_after_verify stayed at 0).
    assert res.status == "passed", res.failure
    assert res.coverage["verify_steps"] > 0


def test_counters_come_from_what_happened(model, oracle):
    s = spec_session(model, oracle)
    to_decode(s, "a")
    s.apply(Draft("a", 3, 3))
    s.apply(Step(1024))  # all accepted
    s.apply(Step(1024))  # no drafts, right after
    s.apply(Draft("a", 2, 0))
    s.apply(Step(1024))  # all rejected
    s.apply(Draft("a", 3, 1))
    s.apply(Abort("a"))  # with drafts in flight
    cov = s.coverage
    assert cov["drafts_accepted_all"] == 1 and cov["drafts_rejected_all"] == 1
    assert cov["zero_draft_after_accept"] == 1
    assert cov["aborts_with_drafts"] == 1
    assert cov["verify_steps"] == 2


def test_a_hit_after_verification_reuses_what_it_accepted(model, oracle):
    s = spec_session(model, oracle)
    to_decode(s, "a", prompt=PROMPT[:10])  # the drafts follow position 11: the boundary at 12 is accepted
    s.apply(Draft("a", 3, 3))
    s.apply(Step(1024))
    s.apply(Drain(1024))
    seq = s.tracks["a"].tokens
    s.apply(Submit("b", seq[:16] + (1,), 1))  # past the accepted drafts, to the boundary after them
    s.apply(Drain(1024))
    assert s.coverage["hits_after_verify"] == 1
    assert s.coverage["snapshots_after_verify"] >= 1  # the boundary inside the accepted drafts was cached


def test_with_the_block_drop_a_hit_gives_its_last_block_back(model, oracle):
    s = spec_session(model, oracle, spec_drop_block=True)
    assert s.speculator.declared == Speculation(3, "per-position", 4)
    s.apply(Submit("a", PROMPT, 1))
    s.apply(Drain(1024))
    s.apply(Submit("b", PROMPT[:8] + (40, 41), 1))
    s.apply(Step(1024))
    first = next(r for r in s.last_plan.requests if r.request_id == "b")
    assert first.start == 4  # the KV and the state at 8 are cached; the hit drops a block


class _PublishesRejected(ReferenceCache):
    """Registers the state after the first rejected draft under the drafted tokens."""

    def _verified(self, req, step, accepted, sampled):
        cols = (step.state_slot, *step.draft_slots)
        drafted = tuple(req.tokens[: step.end]) + tuple(step.drafts)
        super()._verified(req, step, accepted, sampled)
        if accepted < len(step.drafts) and cols[accepted + 1] in req.spare:
            slot = cols[accepted + 1]
            if self.states.register(drafted[: step.end + accepted + 1], slot):
                req.spare.remove(slot)
                self.states.release(slot)


def test_a_cache_that_publishes_a_rejected_draft_fails_though_memory_agrees(model, oracle):
    s = spec_session(model, oracle, factory=_PublishesRejected)
    to_decode(s, "a")
    with pytest.raises(ConformanceFailure, match="rejected") as exc:
        s.apply(Draft("a", 3, 0))
        s.apply(Step(1024))
    assert exc.value.kind == "invariant"


def test_an_implementation_without_speculative_decoding_is_skipped():
    class NoSpec(ReferenceCache):
        spec_option = None

    res = run_single_check(NoSpec, "spec-decode", RunOptions(examples=2, steps=4, write_reports=False))
    assert res.status == "skipped" and "speculative" in res.reason


def test_the_retention_checkers_follow_a_verification_through_its_accepted_drafts(model, oracle):
    """The declared checkpoints a verification step reaches lie up to its
    accepted length: the reference caches the one inside its accepted drafts,
    and neither retention family fails it for that (nor for the hit after)."""
    config = ImplConfig(4, 48, 24, {"spec_tokens": 3})
    s = judged_session(ReferenceCache, config, model, oracle, families=("retention", "hit-rate"), timeout=10.0)
    to_decode(s, "a", prompt=PROMPT[:10])
    s.apply(Draft("a", 3, 3))
    s.apply(Step(1024))
    assert s.coverage["snapshots_after_verify"] == 1
    s.apply(Drain(1024))
    s.apply(Submit("b", s.tracks["a"].tokens[:13] + (2,), 1))
    s.apply(Drain(1024))
    assert s.coverage["checkpoints_offered"] > 0 and s.coverage["hits_after_verify"] == 1


@pytest.mark.parametrize("options", [{}, {"spec_drop_block": True}])
def test_the_spec_walk_builds_every_outcome_in_one_draw(machine, options):
    """spec-walk (issue 22's reach at every seed): one request meets drafts
    wholly accepted, a step without drafts after them, drafts partly accepted,
    drafts all rejected, and a later prompt hits past the accepted ones, also
    where a hit gives a block back to the drafter."""
    m = machine("spec-decode", spec_tokens=3, **options)
    m.verify_each_outcome(0, 2, 1, (5,))
    cov = m.session.coverage
    for key in ("drafts_accepted_all", "zero_draft_after_accept", "drafts_accepted_partial", "drafts_rejected_all",
                "hits_after_verify"):
        assert cov[key] >= 1, (key, cov)
    assert "spec-walk" in m.built
