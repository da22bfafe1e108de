"""Black-box lifetime checks (issue 11, item 5): the pool probe serves, at
idle, what a fresh instance serves, so a cache that leaks fails whatever its
view says; a view without refcounts is reported as reduced assurance; and the
refcount rule of the contract (the cache's own retention is not a reference)."""

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import CachedKV, CacheView, ImplConfig, Layout, StepPlan
from conformance.errors import ConformanceFailure
from conformance.generate.probe_sizing import pool_probe
from conformance.harness.memory import Memory
from conformance.harness.ops import Drain, Probe, Step, Submit, op_from_dict, op_to_dict
from conformance.harness.probe_prompts import probe_prompts
from conformance.judge import judged_session
from conformance.judge.invariants import NO_KV_REFCOUNTS, check_view
from conformance.suite.checks import CHECKS
from conformance.suite.options import RunOptions
from conformance.suite.single import run_single_check

CFG = ImplConfig(block_size=4, num_kv_blocks=24, num_state_slots=8)


class NeverFreeCache(ReferenceCache):
    """The false green of issue 11: never lets go of a finished request's
    blocks or slot, and states an empty view (nothing to contradict)."""

    def _free(self, req):
        req.blocks, req.slot = [], None
        if req in self.running:
            self.running.remove(req)

    def view(self):
        return CacheView()


class SlotLeakCache(ReferenceCache):
    """Takes one state slot more than it lets go of for every request it
    frees, and states no state refcounts (so no view can show the leak)."""

    def _free(self, req):
        super()._free(req)
        self.states.allocate()  # never released

    def view(self):
        v = super().view()
        return CacheView(kv_refcounts=v.kv_refcounts, cached_kv=v.cached_kv, cached_states=v.cached_states,
                         running=v.running)


def test_probe_is_sized_on_a_fresh_instance(model, oracle):
    probe = pool_probe(ReferenceCache, CFG, model, oracle)
    # the generator's budget for one request alone: ceil((P + 1) / B) + 1 <= 24 blocks
    assert probe == Probe(kv_tokens=(24 - 1) * 4 - 1, concurrent=8, expect=8)
    assert pool_probe(ReferenceCache, CFG, model, oracle) is probe  # measured once


def test_probe_prompts_are_fixed():
    short, long = probe_prompts(64, 11, 5)
    assert (short, long) == probe_prompts(64, 11, 5)
    assert len(set(short)) == 5 and all(len(p) == 2 for p in short) and len(long) == 11


def test_probe_op_round_trips_and_validates():
    op = Probe(kv_tokens=91, concurrent=8, expect=8)
    assert op_from_dict(op_to_dict(op)) == op
    with pytest.raises(ValueError, match="probe.expect"):
        op_from_dict({"op": "probe", "kv_tokens": 3, "expect": -1})


def busy(s):
    """Some traffic that a correct cache cleans up after (hits, snapshots, decode)."""
    s.apply(Submit("a", tuple(range(1, 12)), 2))
    s.apply(Drain(1024))
    s.apply(Submit("b", tuple(range(1, 9)) + (40, 41), 2))
    s.apply(Submit("c", tuple(range(20, 33)), 1))
    s.apply(Drain(5))


def test_reference_serves_the_probe_at_idle(model, oracle):
    s = judged_session(ReferenceCache, CFG, model, oracle, timeout=10)
    busy(s)
    s.apply(pool_probe(ReferenceCache, CFG, model, oracle))
    assert not s.active() and s.coverage["requests"] == 3  # the probe's requests are not coverage


def test_never_free_cache_fails_the_probe(model, oracle):
    s = judged_session(NeverFreeCache, CFG, model, oracle, timeout=10)
    busy(s)  # its empty view contradicts nothing
    with pytest.raises(ConformanceFailure) as exc:
        s.apply(pool_probe(NeverFreeCache, CFG, model, oracle))
    assert exc.value.kind == "invariant" and str(exc.value).startswith("lifetime:"), exc.value
    assert "leaked" in str(exc.value)


def test_without_the_lifetime_judge_an_unserved_probe_is_still_a_stall(model, oracle):
    """The session executes the probe, the judge (conformance.judge.lifetime)
    gives the verdict; a session composed without it reports the stall, never a pass."""
    from conformance.harness.session import make_session
    from conformance.judge import standard_checkers
    from conformance.judge.lifetime import PoolProbeServed

    checkers = [c for c in standard_checkers() if not isinstance(c, PoolProbeServed)]
    s = make_session(NeverFreeCache, CFG, model, oracle, checkers, timeout=10)
    busy(s)
    with pytest.raises(ConformanceFailure) as exc:
        s.apply(pool_probe(NeverFreeCache, CFG, model, oracle))
    assert exc.value.kind == "stall", exc.value


def test_a_leaked_state_slot_fails_the_concurrent_probe(model, oracle):
    s = judged_session(SlotLeakCache, CFG, model, oracle, timeout=10)
    s.apply(Submit("a", tuple(range(1, 6)), 1))
    s.apply(Drain(1024))
    probe = pool_probe(SlotLeakCache, CFG, model, oracle)
    assert probe.expect == CFG.num_state_slots  # fresh, it runs one request per slot
    with pytest.raises(ConformanceFailure, match=r"lifetime: at idle, \d of 8 2-token requests"):
        s.apply(probe)
    assert NO_KV_REFCOUNTS not in s.notes and any("state-slot refcounts" in n for n in s.notes)


# The disagg family runs the implementation's disaggregated mode in its own
# session (conformance/suite/disagg.py), not this cache: not probed here.
@pytest.mark.parametrize("spec", [s for s in CHECKS if not s.disagg], ids=lambda s: s.id)
def test_never_free_cache_fails_every_family_at_once(spec):
    """Within the first examples (seconds): the probe, or the pressure rule's stall,
    or (hit-rate) its empty view, never a pass."""
    res = run_single_check(NeverFreeCache, spec.id, RunOptions(examples=4, steps=8, shrink="none",
                                                               write_reports=False))
    assert res.status == "failed", (res.status, res.failure)
    assert res.failure.examples_to_failure <= 2, res.failure
    assert res.failure.kind in ("invariant", "stall", "hit-rate"), res.failure
    if res.failure.kind == "invariant":
        assert res.failure.message.startswith("lifetime:")


def test_no_refcounts_is_reported_not_silently_passed(model, oracle):
    class NoRefcounts(ReferenceCache):
        def view(self):
            v = super().view()
            return CacheView(cached_kv=v.cached_kv, cached_states=v.cached_states, running=v.running)

    s = judged_session(NoRefcounts, CFG, model, oracle, timeout=10)
    busy(s)
    assert NO_KV_REFCOUNTS in s.notes
    res = run_single_check(NoRefcounts, "mid-block-hits", RunOptions(examples=2, steps=6, write_reports=False))
    assert res.status == "passed" and NO_KV_REFCOUNTS in res.notes


def test_refcount_means_holders_other_than_the_cache(model):
    mem = Memory(Layout(4, 4, 2), model.config)
    mem.kv_prov[1] = [(7,), (7, 8), None, None]
    cached = CacheView(kv_refcounts={0: 0, 1: 0}, cached_kv=(CachedKV(1, (7, 8)),))
    assert check_view(cached, mem, idle=True) == []  # only cached: 0, like a free block
    held = CacheView(kv_refcounts={0: 0, 1: 1}, cached_kv=(CachedKV(1, (7, 8)),))
    [problem] = check_view(held, mem, idle=True)
    assert "leaked" in problem and "never the cache's own retention" in problem
    assert check_view(held, mem, idle=False) == []


def test_plan_with_copies_and_no_request_is_executed(model, oracle):
    """Issue 11, item 10a: copies without a request step run, and update() hears of the step."""

    class CopyFirst(ReferenceCache):
        updates = 0

        def schedule(self, budget):
            if not getattr(self, "_copied", False) and self.waiting:
                self._copied = True
                return StepPlan(kv_copies=((0, 1),), state_copies=((0, 1),))
            return super().schedule(budget)

        def update(self, plan, result):
            CopyFirst.updates += 1
            return super().update(plan, result)

    s = judged_session(CopyFirst, CFG, model, oracle, timeout=10)
    s.apply(Submit("a", (1, 2, 3, 4, 5), 1))
    s.memory.kv_prov[0] = [(9,), None, None, None]
    s.memory.conv_prov[0] = s.memory.ssm_prov[0] = (9,)
    s.apply(Step(1024))  # the copy-only plan
    assert s.memory.kv_prov[1][0] == (9,) and s.memory.state_holds(1) == ((9,), (9,))
    assert CopyFirst.updates == 1 and s.active() == ["a"]
    s.apply(Drain(1024))
    assert CopyFirst.updates >= 2 and not s.active()  # then the request's own steps


# ---------------------------------------------------------------- notes: a policy other than the check's


class OwnPolicyCache(ReferenceCache):
    """Keeps its own retention policy whatever the check configures, and says so in retention()."""

    def __init__(self, config=None):
        config = config or ImplConfig()
        options = {k: v for k, v in config.options.items() if k not in ("interval", "admission")}
        super().__init__(ImplConfig(config.block_size, config.num_kv_blocks, config.num_state_slots, options))


def test_retention_note_names_what_differs():
    from conformance.suite.execute import retention_note

    assert retention_note({"interval": 8}, {"interval": 8, "admission": "always"}) is None
    assert retention_note({"interval": 8}, None) is None
    note = retention_note({"interval": 8, "admission": "second-hit"}, {"interval": None, "admission": "always"})
    assert "interval=8" in note and "interval=None" in note and "admission='always'" in note
    assert "tested against its own declaration" in note


def test_a_declaration_other_than_the_checks_is_said_in_the_result():
    res = run_single_check(OwnPolicyCache, "retention-policy", RunOptions(examples=3, steps=6, write_reports=False))
    assert any("tested against its own declaration" in n for n in res.notes), res.notes
    assert not run_single_check(ReferenceCache, "retention-policy",
                                RunOptions(examples=2, steps=6, write_reports=False)).notes


# -- issue 21 (c): what the probe judges, and what holds what it could not get ----------------
class QueuesOffloadAtIdle(ReferenceCache):
    """Decides, when its last request finished, to offload one cached state,
    and issues the offload with its next plan: until that offload completes
    the slot is its source, so the next schedule has one slot fewer.  Correct
    (nothing leaks: the slot comes back when the offload completes)."""

    def __init__(self, config=None):
        super().__init__(config)
        self.queued: int | None = None  # the slot an offload is decided for
        self.moving: dict[int, int] = {}  # transfer id -> slot
        self.decided = False  # one offload, once
        self.leak = False

    def update(self, plan, result):
        finished = super().update(plan, result)
        for d in result.transfers:
            if d.id in self.moving:
                self.states.free[self.moving.pop(d.id)] = None  # the source is free again
        if not self.running and not self.waiting and not self.decided and self.states.snap:
            slot = next(s for s in self.states.snap if s in self.states.free)
            self.states.free.pop(slot)  # the source of the decided offload, until it completes
            self.queued, self.decided = slot, True
            if self.leak:
                self.states.free.popitem()  # and one slot never comes back
        return finished

    def schedule(self, budget):
        plan = super().schedule(budget)
        if self.queued is None:
            return plan
        from dataclasses import replace

        from conformance.contract import Transfer

        t = Transfer(10_000 + self.queued, "offload", "state", f"queued:{self.queued}", self.queued)
        self.moving[t.id], self.queued = self.queued, None
        return replace(plan, transfers=plan.transfers + (t,))


class QueuesOffloadAndLeaks(QueuesOffloadAtIdle):
    def __init__(self, config=None):
        super().__init__(config)
        self.leak = True


def test_a_slot_an_offload_holds_at_the_probe_is_no_leak(model, oracle):
    """Failed before the probe counted its step's transfers: 'lifetime: at
    idle, 7 of 8 ... KV blocks or state slots are held by nothing (leaked)'."""
    s = judged_session(QueuesOffloadAtIdle, CFG, model, oracle, timeout=10)
    s.apply(Submit("a", tuple(range(1, 10)), 1))
    s.apply(Drain(1024))
    s.apply(Probe(kv_tokens=0, concurrent=CFG.num_state_slots, expect=CFG.num_state_slots))


def test_the_probe_names_the_transfers_that_held_what_it_could_not_get(model, oracle):
    s = judged_session(QueuesOffloadAndLeaks, CFG, model, oracle, timeout=10)
    s.apply(Submit("a", tuple(range(1, 10)), 1))
    s.apply(Drain(1024))
    with pytest.raises(ConformanceFailure, match=r"6 of 8 .* schedules 8; transfers of that step or in flight "
                                                 r"held 1 \(state slot \d+ \(offload\)\), and 1 more: KV blocks or "
                                                 r"state slots are held by nothing \(leaked\)"):
        s.apply(Probe(kv_tokens=0, concurrent=CFG.num_state_slots, expect=CFG.num_state_slots))


def test_the_probes_requests_are_held_to_no_declared_policy(model, oracle):
    """The probe's requests count in no coverage and no metric, and are held to
    no retention policy either (conformance/judge/retention.py): its long
    request, sized to the whole pool, reaches more block boundaries than any
    cache has slots.  Failed before: a hit-rate failure inside the probe."""
    from whole_block_cache import WholeBlockCache

    class KeepsNoStepEnd(WholeBlockCache):
        hand_over = False

    cfg = ImplConfig(block_size=4, num_kv_blocks=64, num_state_slots=24)
    s = judged_session(KeepsNoStepEnd, cfg, model, oracle, families=("hit-rate",), timeout=10)
    s.apply(Probe(kv_tokens=248, concurrent=0, expect=0))  # ends on a boundary: 62 checkpoints, 24 slots
    assert s.coverage["requests"] == 0
