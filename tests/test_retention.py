"""Retention policies of the reference and the checks of a declared policy
(families "retention" and "hit-rate"), including the two retention mutants."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure
from conformance.harness.ops import Drain, Submit
from conformance.judge import judged_session
from conformance.judge.metrics import CacheMetrics
from conformance.judge.retention import RetentionChecker
from conformance.suite.checks import get_check
from conformance.suite.options import RunOptions
from conformance.suite.prepared import Resources
from conformance.suite.single import run_single_check
from fault_injection.catalog import get_mutant

torch.set_num_threads(1)  # the tiny model gains nothing from threads; a loaded CPU loses a lot

POLICIES = [{}, {"interval": 0}, {"interval": 8}, {"admission": "second-hit"},
            {"interval": 8, "admission": "second-hit"}, {"interval": 0, "admission": "second-hit"}]


def session(model, oracle, options, factory=ReferenceCache, checks=("retention", "hit-rate")):
    metrics = CacheMetrics()
    s = judged_session(factory, ImplConfig(block_size=4, num_kv_blocks=64, num_state_slots=24, options=options),
                       model, oracle, families=tuple(checks), extra=(metrics,))
    s.metrics = metrics
    return s


def mixed_traffic(s, seed=0):
    """Prompts cut around block boundaries from one base, chunked and whole,
    with decode and a multi-turn continuation."""
    rnd = random.Random(seed)
    base = tuple(rnd.randrange(64) for _ in range(24))
    n = 0
    for _ in range(3):
        for cut in (5, 8, 9, 13, 16, 17):
            n += 1
            s.apply(Submit(f"r{n}", base[:cut] + (rnd.randrange(64),), 2))
            s.apply(Drain(3 if n % 2 else 1024))
    s.apply(Submit("c1", s.tracks[f"r{n}"].tokens + (1, 2), 2, continues=f"r{n}"))
    s.apply(Drain(1024))


@pytest.mark.parametrize("options", POLICIES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "dense")
def test_reference_keeps_its_declared_policy(model, oracle, options):
    s = session(model, oracle, options)
    mixed_traffic(s)  # logits, invariants and both retention families are checked on every step
    assert s.impl.retention()["admission"] == options.get("admission", "always")
    assert s.coverage["checkpoints_offered"] > 0 and s.coverage["state_lookups"] > 0


def test_interval_zero_keeps_prompt_and_sequence_ends_only(model, oracle):
    s = session(model, oracle, {"interval": 0})
    mixed_traffic(s)
    ends = {t.tokens[: t.prompt_len] for t in s.tracks.values()} | {t.tokens[: t.computed] for t in s.tracks.values()}
    cached = {e.tokens for e in s.impl.view().cached_states}
    assert cached and cached <= ends


def test_interval_checkpoints_every_multiple_reached(model, oracle):
    s = session(model, oracle, {"interval": 8}, checks=())
    prompt = tuple(range(1, 21))  # 20 tokens: multiples 8 and 16, prompt end 20
    s.apply(Submit("a", prompt, 1))
    s.apply(Drain(5))  # chunks of 5 tokens: the checkpoints fall inside chunks
    cached = {len(e.tokens) for e in s.impl.view().cached_states}
    assert {8, 16, 20} <= cached and not cached - {8, 16, 20}


def test_second_hit_admits_on_the_second_sighting_only(model, oracle):
    s = session(model, oracle, {"interval": 0, "admission": "second-hit"})
    prompt = tuple(range(3, 12))
    cached = lambda: {e.tokens for e in s.impl.view().cached_states}  # noqa: E731
    s.apply(Submit("first", prompt, 1))
    s.apply(Drain(1024))
    assert prompt not in cached()  # first sighting: the prefix exists, nothing more
    s.apply(Submit("second", prompt, 1))
    s.apply(Drain(1024))
    assert prompt in cached()  # second sighting: it is shared
    s.apply(Submit("third", prompt + (40,), 1))
    s.apply(Drain(1024))
    assert s.metrics.first_start["third"] == len(prompt)  # and reused from then on


def test_undeclared_policy_is_skipped(model, oracle):
    class Silent(ReferenceCache):
        retention = None

    res = run_single_check(Silent, "retention-policy", RunOptions(), Resources(model, oracle))
    assert res.status == "skipped" and "retention" in res.reason


def test_policy_declared_for_some_options_only_is_skipped_for_the_others(model, oracle):
    class IntervalZeroOnly(ReferenceCache):
        def retention(self):
            return super().retention() if self.policy.interval == 0 else None

    # interval 8 unless overridden
    res = run_single_check(IntervalZeroOnly, "retention-policy", RunOptions(), Resources(model, oracle))
    assert res.status == "skipped" and "'interval': 8" in res.reason
    res = run_single_check(IntervalZeroOnly, "retention-policy",
                           RunOptions(examples=3, steps=4, impl_options={"interval": 0}), Resources(model, oracle))
    assert res.status != "skipped"


def test_tail_checkpoints_and_junctions(model, oracle):
    """The rules for engines that checkpoint at hash boundaries (vLLM's align
    mode): the prompt's tail and the block boundary before it; a junction
    where other requests' cached KV stops covering a new prompt."""
    s = session(model, oracle, {"interval": 0}, checks=())
    checker = RetentionChecker("retention")
    s.add_checker(checker)
    checker.decl = {**checker.decl, "prompt_ends": "tail", "hash_unit": 1, "junctions": 4}
    assert checker.checkpoints(0, 11, 11) == [8, 10]  # tail 10, block boundary 8
    assert checker.checkpoints(0, 9, 11) == [8] and checker.checkpoints(8, 11, 11) == [10]
    checker.decl["hash_unit"] = 4
    assert checker.checkpoints(0, 11, 11) == [8] and checker.checkpoints(0, 16, 16) == [12]
    # interval boundaries: anywhere in the chunk, or only where the step ends
    checker.decl.update(interval=8, hash_unit=1)
    assert checker.checkpoints(0, 20, 30) == [8, 16]
    checker.decl["interval_at"] = "chunk-ends"
    assert checker.checkpoints(0, 20, 30) == [] and checker.checkpoints(4, 16, 30) == [16]
    checker.decl["interval"] = None  # dense: every block boundary a step ends on
    assert checker.checkpoints(0, 12, 30) == [12] and checker.checkpoints(9, 11, 11) == [10]
    checker.decl.update(interval=0, hash_unit=4)
    # a junction: "a" cached the KV of 9 shared tokens; "b" starts fresh (no
    # state there), so its junction is 8, a checkpoint once a step reaches it
    shared = tuple(range(1, 10))
    s.apply(Submit("a", shared + (50,), 1))
    s.apply(Drain(1024))
    s.apply(Submit("b", shared + (60, 61), 1))
    view_before = s.last_view
    plan = s.call("schedule", 4)
    s.plan_view = s.call("view")
    step = next(r for r in plan.requests if r.request_id == "b")
    s.tracks["b"].steps = 1  # as after its first step
    got = checker._junction(s, view_before, s.tracks["b"], step)
    assert (step.start, step.end) == (0, 4) and checker.junctions["b"] == 8 and got == []
    later = type(step)("b", 4, 8, step.block_table, step.state_slot)
    assert checker._junction(s, view_before, s.tracks["b"], later) == [8]  # reached on a later step


def test_malformed_declarations_are_contract_failures(model, oracle):
    for bad in ({"prompt_ends": "end"}, {"hash_unit": 0}, {"junctions": True}, {"interval_at": "ends"}):
        class Bad(ReferenceCache):
            def retention(self, bad=bad):
                return {**super().retention(), **bad}

        with pytest.raises(ConformanceFailure) as exc:
            session(model, oracle, {}, factory=Bad)
        assert exc.value.kind == "contract", bad


def test_drop_prompt_end_checkpoint_is_a_hit_rate_failure(model, oracle):
    mutant = get_mutant("drop-prompt-end-checkpoint").wrap(ReferenceCache)
    mixed_traffic(session(model, oracle, {"interval": 8}, mutant, checks=("retention",)))  # no policy violation...
    with pytest.raises(ConformanceFailure) as exc:
        mixed_traffic(session(model, oracle, {"interval": 8}, mutant, checks=("hit-rate",)))
    assert exc.value.kind == "hit-rate"  # ...a performance bug, reported apart


def test_admit_first_sighting_is_a_retention_failure(model, oracle):
    mutant = get_mutant("admit-first-sighting").wrap(ReferenceCache)
    with pytest.raises(ConformanceFailure) as exc:
        mixed_traffic(session(model, oracle, {"admission": "second-hit"}, mutant, checks=("retention",)))
    assert exc.value.kind == "retention"


@pytest.mark.parametrize("check, mutant, kind", [
    ("retention-policy", None, None),
    ("retention-hit-rate", None, None),
    # drop-prompt-end-checkpoint through the machine: tests/test_mutants.py (shrinking it is slow)
    ("retention-policy", "admit-first-sighting", "retention"),
])
def test_checks_through_the_machine(model, oracle, check, mutant, kind):
    factory = get_mutant(mutant).wrap(ReferenceCache) if mutant else ReferenceCache
    spec = get_check(check)
    res = run_single_check(factory, check, RunOptions(examples=8, steps=8), Resources(model, oracle))
    if mutant is None:
        assert res.status == "passed", res.failure
        assert res.metrics["requests"] > 0 and 0 <= res.metrics["state_hit_rate"] <= res.metrics["kv_hit_rate"] <= 1
    else:
        assert (res.status, res.family, res.failure.kind) == ("failed", spec.family, kind)


def test_room_for_checkpoints_is_the_state_memory_the_view_shows():
    """The room a step had for checkpoints comes from the slots the view
    states: on one pool for KV and states (vLLM's view leaves the pages the KV
    group owns out of ``state_refcounts``) the pages running requests hold as
    KV are no room, so a cache that held as many checkpoints as its free state
    memory allowed passes; a view that states every slot (the reference) gets
    the old figure, and one that states none the layout's."""
    from conformance.contract import CachedState, CacheView
    from conformance.judge.retention import state_room

    class Layout:
        num_state_slots = 8  # vLLM: the whole pool (block 0 is its null block)

    class Session:
        layout = Layout()

        def __init__(self, view):
            self.last_view = view
            self.coverage: dict = {}

    a, b, c = (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1,) * 12
    wanted = {a: ("r", 4, 1), b: ("r", 8, 1), c: ("r", 12, 1)}
    # blocks 1-4: a running request's KV (not stated for states); 5: its state;
    # 6: the cached state c; 7: free; 0 (null) stated in neither group
    shared = CacheView(kv_refcounts={1: 1, 2: 1, 3: 1, 4: 1, 7: 0}, state_refcounts={5: 1, 6: 0, 7: 0},
                       cached_states=(CachedState(6, c),))
    assert state_room(shared, 8) == 2  # the old figure, 8 slots minus the 1 running, said 7
    check = RetentionChecker("hit-rate")
    check.decl = {"interval": 4, "admission": "always"}
    check._check_capacity(Session(shared), wanted, type("Now", (), {"states": {b, c}})())  # 2 held: all it could
    with pytest.raises(ConformanceFailure) as exc:  # 1 held with room for 2: still a hit-rate failure
        check._check_capacity(Session(shared), wanted, type("Now", (), {"states": {c}})())
    assert exc.value.kind == "hit-rate" and "with room for 2 (state slots 6, 7, free or caching" in str(exc.value)
    # every slot stated (its own slot pool): slots minus those running requests hold, as before
    separate = CacheView(state_refcounts={0: 1, 1: 1, 2: 2, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0},
                         cached_states=(CachedState(2, c),))
    assert state_room(separate, 8) == 8 - 2
    assert state_room(CacheView(), 8) == 8 and state_room(None, 8) == 8  # nothing stated: the layout


def test_a_state_the_schedule_evicted_is_not_held_because_it_registered_the_prefix_elsewhere():
    """The expected-hit oracle's local floor is what the views before and after
    one schedule() list as the same entry.  Seen on vLLM (hard-prefixes, GDN,
    match unit 1, seed 1): a running request's allocation evicted the state at
    16 (slot 10) in the very schedule that started r13 fresh, and vLLM
    registered r13's own [0, 16) state in its new slot at allocation; by prefix
    alone the state at 16 was 'held' and r13's miss a hit-rate failure."""
    from conformance.contract import CachedKV, CachedState, CacheView
    from conformance.judge.reuse import HeldAcross

    prompt = tuple(range(1, 27))
    kv = (CachedKV(1, prompt[:4]), CachedKV(2, prompt[:8]), CachedKV(3, prompt[:12]), CachedKV(4, prompt[:16]))
    before = CacheView(cached_kv=kv, cached_states=(CachedState(10, prompt[:16]),))
    after = CacheView(cached_kv=kv, cached_states=(CachedState(24, prompt[:16]),))  # slot 10 went to another request
    held = HeldAcross(before, after, 4)
    assert held.kv_servable(prompt) == 16 and held.best_reuse(prompt, 16) == 0
    kept = HeldAcross(before, CacheView(cached_kv=kv, cached_states=(CachedState(10, prompt[:16]),)), 4)
    assert kept.best_reuse(prompt, 16) == 16
    assert HeldAcross(None, after, 4).kv_servable(prompt) == 0  # no view before: nothing was held
