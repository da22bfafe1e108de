"""Transfers under the generator's control: the decisions are operations,
they round-trip through repro files (old files still load), replay exactly,
and the expected-hit oracle judges what a correct cache could reuse."""

from __future__ import annotations

import json

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Deliver, Drain, HoldTransfers, Step, StoreEvict, Submit, op_from_dict, op_to_dict
from conformance.harness.oracle import Oracle
from conformance.judge import judged_session
from conformance.model import ModelConfig, TinyHybrid
from conformance.results.repro import load
from conformance.suite.replay import replay

LONG = tuple(range(11, 25))
JUNK = [tuple(range(26 + 18 * i, 44 + 18 * i)) for i in range(2)]  # below the vocabulary of 64
CONFIG = ImplConfig(block_size=4, num_kv_blocks=12, num_state_slots=5, options={"host_tier": True})


@pytest.fixture(scope="module")
def tiny():
    return TinyHybrid(ModelConfig())


def _displaced(decisions) -> list:
    """A cached, displaced to the host tier by junk, asked for again; its loads held, then decided."""
    ops = [HoldTransfers(), Submit("a", LONG), Drain(1024)]
    for i, junk in enumerate(JUNK):
        ops += [Submit(f"j{i}", junk), Drain(1024)]
    return ops + [Submit("c", LONG + (5,)), Step(1)] + list(decisions) + [Drain(1024)]


def test_new_operations_round_trip_and_reject_bad_fields():
    for op in (HoldTransfers(), Deliver(2, "short", 1), StoreEvict(3)):
        assert op_from_dict(json.loads(json.dumps(op_to_dict(op)))) == op
    assert op_to_dict(HoldTransfers()) == {"op": "hold-transfers"}
    for bad, where in (({"op": "deliver", "outcome": "lost"}, "deliver.outcome"),
                       ({"op": "deliver", "delay": -1}, "deliver.delay"),
                       ({"op": "store-evict", "pick": "x"}, "store-evict.pick")):
        with pytest.raises(ValueError, match=where):
            op_from_dict(bad)


def test_old_repro_files_still_load():
    repro = load("fixtures/scenarios/late-snapshot-published-too-late.json")
    ops = repro.operations
    assert ops and all(type(op).__name__ in ("Submit", "Drain", "Step", "Abort") for op in ops)


def test_held_loads_wait_for_decisions_and_the_reference_survives_each(tiny):
    oracle = Oracle(tiny)
    for decisions in ([Deliver(0, "ok", 2)], [Deliver(0, "fail")], [Deliver(1, "short"), Deliver(0, "ok")],
                      [StoreEvict(0)]):
        s = judged_session(ReferenceCache, CONFIG, tiny, oracle, families=("expected-hit",))
        ops = _displaced(decisions)
        held_at = None
        for op in ops:
            s.apply(op)
            if isinstance(op, Step) and held_at is None:
                held_at = len(s.pending_loads())
        assert held_at, "the displaced prefix must come back through held loads"
        counts = s.control.counts
        assert counts["held"] >= held_at
        if decisions and isinstance(decisions[0], Deliver) and decisions[0].outcome == "fail":
            assert counts["failed"] == 1
        if decisions and isinstance(decisions[0], StoreEvict):
            assert counts["store_evicted"] == 1
        assert s.idle() and not s.pending_loads()


def test_an_entry_whose_load_broke_is_not_held_for_the_next_request(tiny):
    """A load delivered short, completed by a step that runs no request, then a
    second request for the same prefix: a correct cache may stop trusting the
    broken entry, so the oracle must not hold it for the second request either
    (it used to learn of the broken load only at the next step with requests)."""
    s = judged_session(ReferenceCache, CONFIG, tiny, Oracle(tiny), families=("expected-hit",))
    ops = _displaced([Deliver(0, "short")])[:-1] + [Step(1), Submit("d", LONG + (6, 7, 8)), Drain(1024)]
    for op in ops:
        s.apply(op)
    assert s.control.counts["short"] == 1 and s.idle()


def test_transfer_decisions_replay_exactly_from_a_repro_file(tmp_path, tiny):
    """A failure found with decisions in it (a load completing two steps late
    meets a cache that does not wait for its loads) replays to the same
    failure, at the same operation, from the file alone."""
    from fault_injection.catalog import get_mutant

    factory = get_mutant("tier-load-not-awaited").wrap(ReferenceCache)
    ops = _displaced([Deliver(0, "ok", 2)])
    s = judged_session(factory, CONFIG, tiny, Oracle(tiny))
    with pytest.raises(ConformanceFailure) as first:
        for op in ops:
            s.apply(op)
    doc = {"schema": "hybrid-cache-conformance/repro", "schema_version": 2, "impl": "reference",
           "mutant": "tier-load-not-awaited", "faults": [], "seed": 0,
           "impl_config": {"block_size": 4, "num_kv_blocks": 12, "num_state_slots": 5,
                           "options": {"host_tier": True}},
           "model": {}, "steps": [op_to_dict(op) for op in s.history.ops]}
    path = tmp_path / "race.json"
    path.write_text(json.dumps(doc))
    again = [replay(load(path), model=tiny) for _ in range(2)]
    assert all(o.reproduced and o.kind == first.value.kind and o.message == str(first.value) for o in again)
    assert again[0].failed_at == again[1].failed_at == len(s.history.ops) - 1
    # and the same operations on the clean reference pass
    assert not replay(load(path), cli_mutant="none", model=tiny).reproduced


def test_expected_hit_fails_a_cache_that_reuses_less_than_it_holds(tiny):

    repro = load("fixtures/scenarios/tier-local-longer.json")
    out = replay(repro, model=tiny)
    assert out.reproduced and out.kind == "hit-rate" and "could reuse 7" in out.message


def test_a_hit_longer_than_memory_held_is_a_correctness_failure(tiny):
    """A request that starts past what its blocks and state hold: the oracle
    names it (kind invariant), even when the logits would agree."""
    from conformance.judge.expected_hit import ExpectedHit

    class Executed:
        def __init__(self, reads):
            from conformance.contract import RequestStep

            self.step = RequestStep("x", 4, 6, (0, 1), 0)
            self.reads = reads

    class Track:
        computed = None

    class Session:
        tracks = {"x": Track()}

    check = ExpectedHit()
    check.computed(Session(), Executed("state slot 0: conv ok, matrix ok; KV [0, 4): ok"))
    with pytest.raises(ConformanceFailure) as exc:
        check.computed(Session(), Executed("state slot 0: conv ok, matrix state after 3 tokens of this sequence "
                                           "(wanted 4); KV [0, 4): ok"))
    assert exc.value.kind == "invariant"


def test_checkpoints_beyond_the_free_slots_are_not_failed():
    """Several checkpoints reached in one step with fewer slots free than
    checkpoints: holding as many as there was room for passes; holding fewer
    fails (hit-rate)."""
    from conformance.contract import CachedState, CacheView
    from conformance.judge.retention import RetentionChecker

    class Layout:
        num_state_slots = 3

    class Session:
        layout = Layout()
        coverage: dict = {}

        def __init__(self, view):
            self.last_view = view

    check = RetentionChecker("hit-rate")
    check.decl = {"interval": 4, "admission": "always"}
    a, b, c = (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1,) * 12
    wanted = {a: ("r", 4, 1), b: ("r", 8, 1), c: ("r", 12, 1)}
    # two slots run requests, one holds a snapshot: room for one of the three
    full = CacheView(state_refcounts={0: 1, 1: 1, 2: 0}, cached_states=(CachedState(2, c),))
    check._check_capacity(Session(full), wanted, type("Now", (), {"states": {c}})())
    empty = CacheView(state_refcounts={0: 1, 1: 0, 2: 0}, cached_states=())
    with pytest.raises(ConformanceFailure) as exc:
        check._check_capacity(Session(empty), wanted, type("Now", (), {"states": set()})())
    assert exc.value.kind == "hit-rate"


def test_an_entry_in_transit_when_the_request_was_matched_is_not_held_against_it(tiny):
    """Two requests compared in one schedule: the first one's load
    destinations evict a state the second could reuse, whose offload runs
    only after the schedule; the second was matched while that state was
    held nowhere, so reusing the shorter prefix is right (the oracle's floor
    includes the schedule of a plan that only carries transfers)."""
    a = (36, 62, 28, 12, 56, 29, 60, 33, 31, 39, 2, 26, 34, 40, 33, 58, 59, 20, 29, 8, 53, 27, 6, 31, 5, 26, 9, 10,
         9, 4, 45)
    config = ImplConfig(block_size=4, num_kv_blocks=28, num_state_slots=10, options={"host_tier": True})
    s = judged_session(ReferenceCache, config, tiny, Oracle(tiny), families=("expected-hit",))
    for op in (Submit("r1", a, 1), Drain(1024), Submit("r2", a[:2], 1),
               Submit("r3", (19, 57, 43, 21, 0, 9, 0, 20, 45, 0, 27), 1), Submit("r4", a[:4] + (50,), 1),
               Drain(1024), Submit("r5", a[:19] + (17, 55, 2, 60), 2), Submit("r6", a[:21] + (16, 31, 12, 53), 1),
               Drain(3)):
        s.apply(op)
    assert s.idle()


class _NeverLoads(ReferenceCache):
    """Ignores the host tier: offloads what it evicts, never loads it back."""

    def _remote_wins(self, local, remote):
        return False


class _LoadsOnce(ReferenceCache):
    """Loads for the first request that asks the host tier, never again."""

    def _remote_wins(self, local, remote):
        first = not getattr(self, "_asked", False)
        self._asked = True
        return first and remote > local


def _run(factory, config, tiny, ops):
    s = judged_session(factory, config, tiny, Oracle(tiny), families=("expected-hit",))
    for op in ops:
        s.apply(op)
    return s


def test_a_cache_that_ignores_the_host_tier_is_failed_where_its_own_admission_took_the_room(tiny):
    """Two state slots, cached junk blocks unreferenced: room to load a
    displaced prefix back (the reference does, and hits it).  A cache that
    recomputes instead took a slot for its own running state, so the view
    after its schedule shows one slot free; the oracle used to call that no
    room and excuse the host tier.  What the request took itself is its room."""
    config = ImplConfig(block_size=4, num_kv_blocks=8, num_state_slots=2, options={"host_tier": True})
    ops = [Submit("a", LONG, 1), Drain(1024)]
    for i, junk in enumerate(JUNK):
        ops += [Submit(f"j{i}", junk, 1), Drain(1024)]
    ops += [Submit("c", LONG + (5,), 1), Drain(1024)]
    s = _run(ReferenceCache, config, tiny, ops)
    assert s.coverage["tier_hits"] == 1 and s.coverage["remote_expected"] == 1  # the host tier decided
    with pytest.raises(ConformanceFailure) as exc:
        _run(_NeverLoads, config, tiny, ops)
    assert exc.value.kind == "hit-rate" and "host tier 12" in str(exc.value)


def test_a_fresh_copy_of_an_entry_whose_load_broke_is_held_again(tiny):
    """A load delivered short: its host copy is not held for later requests.
    Once the block is recomputed, evicted and offloaded again, the store holds
    a new copy under the same key, and a cache that never loads it is failed
    (the oracle used to distrust the key for the rest of the session)."""
    more = [tuple(reversed(JUNK[0])), tuple(reversed(JUNK[1])), tuple(x * 7 % 64 for x in range(1, 19))]
    ops = _displaced([Deliver(0, "short")])
    for i, junk in enumerate(more):
        ops += [Submit(f"k{i}", junk, 1), Drain(1024)]
    ops += [Submit("d", LONG + (6, 7, 8)), Drain(1024)]
    s = _run(ReferenceCache, CONFIG, tiny, ops)
    assert s.control.counts["short"] == 1 and s.coverage["tier_hits"] == 1
    with pytest.raises(ConformanceFailure) as exc:
        _run(_LoadsOnce, CONFIG, tiny, ops)
    assert exc.value.kind == "hit-rate" and "request d" in str(exc.value)


def test_device_entries_registered_by_the_schedule_itself_are_not_held():
    """The remote part counts a device entry only where the views before and
    after the schedule() both list it: one that appears only after it was
    registered by that plan (vLLM registers the blocks it allocates for a
    step) and its content is not written yet."""
    from conformance.contract import CachedKV, CachedState, CacheView
    from conformance.judge.expected_hit import StoreIndex, longest_held
    from conformance.judge.reuse import HeldAcross, ViewIndex

    prompt = tuple(range(1, 11))
    kv = tuple(CachedKV(k, prompt[: (k + 1) * 4]) for k in range(2))
    view = CacheView(cached_kv=kv, cached_states=(CachedState(0, prompt[:8]),))
    nothing = type("Store", (), {"entries": {}})()
    assert longest_held(prompt, ViewIndex(view, 4), StoreIndex(nothing, 4), 4, 4) == 8  # the view after alone
    assert longest_held(prompt, HeldAcross(None, view, 4), StoreIndex(nothing, 4), 4, 4) == 0
    assert longest_held(prompt, HeldAcross(view, view, 4), StoreIndex(nothing, 4), 4, 4) == 8


class _NoTierUnit(ReferenceCache):
    """The reference with its second tier, declaring no tier unit."""

    def retention(self):
        decl = super().retention()
        return None if decl is None else {k: v for k, v in decl.items() if k != "tier_unit"}


def test_tier_races_says_why_when_the_oracle_cannot_judge_the_tier():
    """Without a declared tier unit the expected-hit oracle never judges the
    host tier (remote_expected stays at 0): tier-races fails its coverage, and
    the message names the missing declaration rather than an unlucky draw."""
    from conformance.suite.options import RunOptions
    from conformance.suite.single import run_single_check

    res = run_single_check(_NoTierUnit, "tier-races", RunOptions(examples=6, steps=8, shrink="none",
                                                                  write_reports=False))
    assert res.status == "failed" and res.failure.kind == "coverage", res.failure
    assert "remote_expected" in res.failure.message and "declares no tier unit" in res.failure.message
    assert any("declares no tier unit" in n for n in res.notes)
