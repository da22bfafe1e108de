"""Environment faults: the reference (with its host tier) survives each of
them, they compose, they record where they fired, a fault that never fired
fails the run, and an implementation that trusts its tier blindly is caught."""

import json

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.adapters.reference.host_tier import HostTier
from conformance.cli.main import main
from conformance.suite.run import RunOptions, run
from fault_injection.environment import FAULTS, Trigger, build_faults

TIER = {"host_tier": True}


def faulty_run(faults, impl="reference", examples=8, options=TIER, seed=0):
    return run(RunOptions(impl=impl, checks=("eviction-pressure",), faults=tuple(faults), impl_options=dict(options),
                          examples=examples, steps=10, seed=seed, write_reports=False, shrink="ops"))


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_reference_survives_fault(name):
    result = faulty_run([f"{name}:p=1"])
    assert result.ok, [(c.id, c.failure and c.failure.message) for c in result.checks]
    info = result.faults[name]
    assert info["exercised"] and info["fired"] > 0 and info["where"], info
    assert {"step", "transfer", "direction", "key", "what"} <= set(info["where"][0])


def test_faults_compose():
    # p=0.5 for the fault with the fewest opportunities (loads): at 0.3 one seed's 13 loads drew none
    names = ["evict-before-load:p=0.5", "lost-entry:p=0.3", "transfer-corrupt:p=0.3", "transfer-reorder:p=0.5",
             "alloc-fail:p=0.1"]
    result = faulty_run(names, examples=12)
    assert result.ok, [(c.id, c.failure and c.failure.message) for c in result.checks]
    assert all(info["fired"] > 0 for info in result.faults.values()), result.faults


def test_a_fault_that_never_fired_fails_the_run():
    """With the host tier turned off nothing is ever transferred: the fault proves nothing."""
    result = faulty_run(["transfer-corrupt"], options={"host_tier": False}, examples=3)
    assert not result.ok
    assert result.faults["transfer-corrupt"]["exercised"] is False
    check = result.checks[-1]
    assert check.id == "faults-exercised" and check.status == "failed" and "transfer-corrupt" in check.failure.message


def test_faults_turn_the_reference_host_tier_on():
    """Asking for transfer faults on the reference gives it the tier they need."""
    result = faulty_run(["transfer-fail:p=1"], options={}, examples=3)
    assert result.ok and result.faults["transfer-fail"]["fired"] > 0


class TrustingTier(HostTier):
    """Believes whatever a completed load says it delivered (no checksum)."""

    def _loaded(self, info, d):
        super()._loaded(dict(info, expected=d.checksum), d)


class TrustingCache(ReferenceCache):
    def __init__(self, config=None):
        super().__init__(config)
        if self.tier is not None:
            self.tier = TrustingTier(self)


def test_a_cache_that_trusts_corrupted_loads_is_caught():
    result = faulty_run(["transfer-corrupt:p=1"], impl="test_faults:TrustingCache", examples=12)
    failed = [c for c in result.checks if c.status == "failed"]
    assert failed and failed[0].failure.kind == "logits", [(c.id, c.status) for c in result.checks]


def test_trigger_parameters():
    t = Trigger.parse("p=0.25:step=3:request=r2:limit=1")
    assert (t.probability, t.step, t.request, t.limit) == (0.25, 3, "r2", 1)
    with pytest.raises(KeyError):
        Trigger.parse("often=yes")
    with pytest.raises(KeyError):
        build_faults(("no-such-fault",), 0)


def test_step_trigger_limits_where_it_fires():
    result = faulty_run(["alloc-fail:p=1:limit=1"], examples=4)
    info = result.faults["alloc-fail"]
    assert result.ok and info["fired"] >= 1
    # at most one fire per session: never more fires than sessions that offloaded
    assert info["fired"] <= result.checks[0].examples


def test_cli_records_faults_in_results_json(tmp_path):
    rc = main(["run", "--check", "eviction-pressure", "--examples", "4", "--faults", "transfer-fail:p=1",
               "--option", "host_tier=true", "--report-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and doc["faults"]["transfer-fail"]["fired"] > 0
    assert main(["run", "--faults", "no-such-fault", "--report-dir", str(tmp_path)]) == 2


def test_tier_reuse_turns_the_tier_on_and_skips_an_implementation_without_one(tmp_path):
    """The tier check runs with the implementation's own tier option and
    really reloads what was evicted; an implementation without a tier is
    skipped with a reason, not failed."""
    import sys
    import types

    # (12 examples: since the reach rules share the draws, 6 reached no host hit over a local one at seed 0)
    result = run(RunOptions(checks=("tier-reuse",), examples=12, steps=10, write_reports=False))
    (check,) = result.checks
    assert check.status == "passed" and check.coverage["tier_loads"] > 0, check
    assert check.coverage["tier_offloads"] >= check.coverage["tier_loads"]

    class NoTier(ReferenceCache):
        tier_option = None

    module = types.ModuleType("hcc_no_tier")
    module.NoTier = NoTier
    sys.modules["hcc_no_tier"] = module
    try:
        (skipped,) = run(RunOptions(impl="hcc_no_tier:NoTier", checks=("tier-reuse",), write_reports=False)).checks
    finally:
        del sys.modules["hcc_no_tier"]
    assert skipped.status == "skipped" and "no second tier" in skipped.reason


# -- a fault on an offload breaks the load that reads its copy back --------------------------
class _OnOffloads:
    """The fault, firing only on the offload of the state after 8 tokens: that
    copy is broken at rest, the wire back and every other copy are whole."""

    def should_fire(self, transfer):
        held = self.session.memory.state_holds(transfer.device)[1] if transfer.kind == "state" else None
        return transfer.direction == "offload" and held is not None and len(held) == 8 \
            and super().should_fire(transfer)


class CorruptOffloads(_OnOffloads, FAULTS["transfer-corrupt"]):
    pass


class PartialOffloads(_OnOffloads, FAULTS["transfer-partial"]):
    pass


A = (38, 22, 61, 33, 3, 36, 37, 6, 54, 24, 30, 58, 28, 10, 9, 57, 56, 28, 10)
JUNK = tuple(range(1, 32))  # distinct from A: it turns A's states over to the host tier


@pytest.mark.parametrize("fault", [CorruptOffloads, PartialOffloads])
def test_a_copy_broken_at_its_offload_is_not_expected_from_the_host_tier(fault):
    """Issue 21 (a): under transfer-corrupt and transfer-partial the expected-hit
    oracle held the reference to a host copy whose offload the fault had broken
    (its provenance whole, its bytes not): the reference loaded it, found the
    checksum wrong and recomputed, and was failed "reused 0 tokens, but a
    correct cache could reuse 8 (host tier 8)".  No load of such a copy can
    verify, so the request that read it is excused and the copy is held for no
    one.  (Failed before the transport marked loads intact.)"""
    from conformance.contract import ImplConfig
    from conformance.harness.ops import Drain, Submit
    from conformance.harness.oracle import Oracle
    from conformance.judge import judged_session
    from conformance.model import ModelConfig, TinyHybrid

    model = TinyHybrid(ModelConfig())
    config = ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=12, options=dict(TIER))
    s = judged_session(ReferenceCache, config, model, Oracle(model), families=("expected-hit",))
    f = fault(Trigger(probability=1.0), seed=0)
    f.attach(s)
    for op in (Submit("a", A, 2), Drain(9), Submit("junk", JUNK, 1), Drain(1024), Submit("a2", A, 1),
               Submit("b", A[:12] + (61, 11, 7, 50, 28, 43, 19, 52, 14, 22, 4), 2), Drain(1)):
        s.apply(op)
    fired = [e for e in s.history.as_data() if e["event"] == "fault"]
    assert fired and all(e["transfer"]["direction"] == "offload" for e in fired), fired
    loads = [e for e in s.history.as_data() if e["event"] == "transfer-done" and "intact" in e]
    assert loads and not all(e["intact"] for e in loads), loads  # b loaded the broken copy and recomputed
    assert s.tracks["b"].done


def test_under_faults_a_tier_decided_admission_whose_load_broke_is_the_situation():
    """Issue 21 (a): under transfer-partial (p=0.5) every admission only the host
    tier could serve had a load the fault broke, so the expected-hit oracle
    excused each and tier-races failed its coverage ('remote_expected stayed
    at 0'): a correct cache failed for the fault's doing.  Under faults the
    situation is met, intact (judged) or broken (excused, the recovery judged
    by logits), and the result says which.  (Failed before.)"""
    result = run(RunOptions(impl="reference", checks=("tier-races",), faults=("transfer-partial",), seed=0,
                            write_reports=False))
    check = result.checks[0]
    assert result.ok, [(c.id, c.failure and c.failure.message) for c in result.checks]
    assert check.coverage.get("remote_excused", 0) > 0
    if not check.coverage.get("remote_expected"):
        assert any("remote_expected stayed at 0" in n for n in check.notes), check.notes


def test_without_faults_a_broken_load_does_not_stand_for_an_intact_one():
    from conformance.generate.machine import Recorder
    from conformance.suite.checks import get_check
    from conformance.suite.verdict import coverage_failure

    rec = Recorder()
    rec.coverage.update(tier_loads=3, loads_held=2, store_evicted_during_load=1, remote_expected=0, remote_excused=4)
    spec = get_check("tier-races")
    assert coverage_failure(spec, rec, faulted=False).message.startswith("the tier situation never occurred: "
                                                                         "remote_expected stayed at 0")
    assert coverage_failure(spec, rec, faulted=True) is None and rec.notes


def test_under_faults_a_request_that_went_on_after_its_load_broke_stands_for_a_tier_hit():
    """tier-reuse asks for tier_hits (a hit whose step read loaded bytes); under
    transfer-partial every load the reference verifies comes back short and
    is rejected, so tier_hits stayed at 0 (seed 1 at p=0.5, every seed at
    p=1) and a correct cache failed coverage.  (Failed before.)"""
    result = run(RunOptions(impl="reference", checks=("tier-reuse",), faults=("transfer-partial:p=1",), seed=0,
                            examples=10, steps=10, write_reports=False))
    assert result.ok, [(c.id, c.failure and c.failure.message) for c in result.checks]
    check = result.checks[0]
    assert check.coverage["tier_hits"] == 0 and check.coverage["tier_recoveries"] > 0, check.coverage
    assert any("tier_hits stayed at 0" in n for n in check.notes), check.notes


# Every environment fault at once, on every check of the quick profile: the
# reference survives them with each check's situation reached and each fault
# fired and consumed (issue 21: only eviction-pressure was ever run under
# faults, and three faults failed a correct cache elsewhere).  Fewer examples
# than the profile's (its 12 steps: pressure-while-running's aborts_mid_prefill
# needs them), to stay cheap on every CI run; the sweep of each fault
# alone at seeds 0-2 over the whole profile is in docs/fault-injection.md.
# Not marked slow: it is the default run's (CI's) one whole profile under
# faults, and no default test checks it in less (about 40 s of CPU).
ALL_FAULTS = tuple(f"{name}:p=0.3" for name in sorted(FAULTS))


def test_the_reference_passes_the_whole_quick_profile_under_every_fault():
    result = run(RunOptions(impl="reference", profile="quick", faults=ALL_FAULTS, examples=12, steps=12, seed=0,
                            write_reports=False))
    assert [c.id for c in result.checks if c.status != "passed"] == [], \
        [(c.id, c.status, c.failure and c.failure.message) for c in result.checks if c.status != "passed"]
    from conformance.suite.checks import PROFILES
    from conformance.suite.execute import FAULTS_EXERCISED

    # every check of the profile, and the faults' own check (passed above: each fired and was consumed)
    assert [c.id for c in result.checks] == [s.id for s in PROFILES["quick"].checks] + [FAULTS_EXERCISED]
    assert result.ok
    assert all(info["fired"] and info["consumed"] for info in result.faults.values()), result.faults
