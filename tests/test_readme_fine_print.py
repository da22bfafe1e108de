"""The README's fine print of the contract (issue 21, o), each answer pinned
to what the harness does: caches written from the README alone asked each of
these questions."""

from __future__ import annotations

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import RESUME, ImplConfig, StepPlan, Transfer
from conformance.harness.ops import Drain, HoldTransfers, Step, Submit
from conformance.judge import judged_session
from conformance.suite.checks import get_check
from conformance.suite.execute import check_impl_config

CFG = ImplConfig(block_size=4, num_kv_blocks=16, num_state_slots=8)


class Spy(ReferenceCache):
    """Records the order of the harness's calls and the budgets it hands out."""

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[str] = []

    def schedule(self, budget):
        self.calls.append(f"schedule({budget})")
        return super().schedule(budget)

    def update(self, plan, result):
        self.calls.append("update")
        return super().update(plan, result)

    def view(self):
        self.calls.append("view")
        return super().view()


def test_view_is_called_between_schedule_and_update_and_budget_is_per_step(model, oracle):
    s = judged_session(Spy, CFG, model, oracle)
    s.apply(Submit("a", tuple(range(1, 8)), 1))
    s.apply(Submit("b", tuple(range(20, 27)), 1))
    s.apply(Step(5))
    assert s.impl.calls == ["schedule(5)", "view", "update", "view"]
    plan = s.last_plan
    assert sum(rs.end - rs.start for rs in plan.requests) == 5  # shared by a and b, not 5 each


class OffloadsAndOverwrites(ReferenceCache):
    """Offloads the block its request is about to write, in that very plan."""

    def schedule(self, budget):
        plan = super().schedule(budget)
        if plan.requests and plan.requests[0].request_id == "b":
            block = plan.requests[0].block_table[0]
            return StepPlan(plan.requests, plan.kv_copies, plan.state_copies,
                            plan.transfers + (Transfer(900, "offload", "kv", "before", block),))
        return plan


def test_an_offload_reads_its_source_before_the_step_that_carries_it(model, oracle):
    s = judged_session(OffloadsAndOverwrites, CFG, model, oracle)
    b = tuple(range(30, 35))
    for op in (Submit("a", tuple(range(1, 6)), 1), Drain(1024), Submit("b", b, 1), Step(1024)):
        s.apply(op)
    block = s.last_plan.requests[0].block_table[0] if s.last_plan.requests else None
    entry = s.runner.transport.store.get("before")
    assert entry is not None and entry.payload.prov["kv"] != s.memory.kv_prov[block]  # what was there before
    assert s.memory.kv_prov[block][-1] == b[:4]  # what the step wrote after the offload read it


def test_the_tier_option_reaches_the_constructor_as_an_option():
    tier = ("spy_tier", 7)
    assert check_impl_config(get_check("tier-reuse"), {}, None, tier).options["spy_tier"] == 7
    assert "spy_tier" not in check_impl_config(get_check("mid-block-hits"), {}, None, tier).options
    # an --option of the same name wins (with --faults, prepare_run() sets it for every check the same way)
    assert check_impl_config(get_check("tier-reuse"), {"spy_tier": 0}, None, tier).options["spy_tier"] == 0


class ResumesLoadedSlot(ReferenceCache):
    """Runs a request in the very slot its tier load landed in (RESUME), instead
    of copying the loaded state into a fresh slot."""

    def _admit(self, req, kv_copies):
        remote = self.tier.remote_length(req.request_id) if self.tier is not None else None
        if not super()._admit(req, kv_copies):
            return False
        if remote is not None and req.init.kind == "copy" and req.computed == remote:
            loaded = req.init.source
            self.states.release(req.slot)  # the fresh slot is not needed
            self.states.unregister(loaded)  # the loaded state is consumed: no longer a cached entry
            req.pins.remove(("state", loaded))  # its reference is now the request's own
            req.slot, req.init = loaded, RESUME
        return True


def test_a_first_step_may_resume_the_slot_a_load_landed_in(model, oracle):
    config = ImplConfig(block_size=4, num_kv_blocks=12, num_state_slots=5, options={"host_tier": True})
    s = judged_session(ResumesLoadedSlot, config, model, oracle, families=("expected-hit",))
    long = tuple(range(11, 25))
    ops = [HoldTransfers(), Submit("a", long), Drain(1024)]
    for i in range(2):
        ops += [Submit(f"j{i}", tuple(range(26 + 18 * i, 44 + 18 * i))), Drain(1024)]
    for op in ops + [Submit("c", long + (5,)), Step(1), Drain(1024)]:
        s.apply(op)
    first = next(e for e in s.history.as_data() if e["event"] == "plan"
                 and any(r["request_id"] == "c" for r in e["requests"]))
    c = next(r for r in first["requests"] if r["request_id"] == "c")
    assert c["start"] > 0 and c["state_init"] == "resume", c
    assert s.idle()


@pytest.mark.parametrize("together", [True, False])
def test_a_sighting_is_computing_through_a_checkpoint(model, oracle, together):
    """Second-hit: two requests computing through one prompt end in one step
    admit it in that step; a request that reuses it does not sight it."""
    config = ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=12, options={"admission": "second-hit"})
    s = judged_session(ReferenceCache, config, model, oracle, families=("retention", "hit-rate"))
    prompt = tuple(range(3, 10))
    ops = [Submit("a", prompt, 1), Submit("b", prompt, 1), Step(1024)] if together else \
        [Submit("a", prompt, 1), Drain(1024), Submit("b", prompt, 1), Drain(1024)]
    for op in ops:
        s.apply(op)
    sighted = {c: s.coverage.get(c, 0) for c in ("first_sightings", "repeat_sightings", "admissions")}
    assert sighted["repeat_sightings"] >= 1 and sighted["admissions"] >= 1, sighted
