"""The session: applying operations, contract enforcement, and turning an
implementation's raise or hang into a finding."""

import time

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig, RequestStep, StepPlan
from conformance.errors import ConformanceFailure, ImplementationError
from conformance.harness.ops import Abort, Drain, Step, Submit
from conformance.judge import judged_session

CFG = ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=16)
BASE = tuple(range(1, 30))


def session(model, oracle, factory=ReferenceCache, timeout=5.0):
    return judged_session(factory, CFG, model, oracle, timeout=timeout)


def test_reference_reuses_mid_block_prefix_and_snapshot(model, oracle):
    s = session(model, oracle)
    s.apply(Submit("a", BASE[:10], 2))
    s.apply(Drain(1024))
    s.apply(Submit("b", s.tracks["a"].tokens + (5, 6), 1, continues="a"))
    s.apply(Drain(3))
    assert s.coverage["prefix_hits"] == 1
    assert s.coverage["multi_turn_hits"] == 1
    assert s.coverage["mid_block_hits"] == 1  # the hit ends at 11, inside block 2
    assert s.coverage["snapshot_reuse"] == 1
    assert s.coverage["chunked_prefills"] >= 1  # cut at block boundaries and the prompt end
    assert not s.active()


def test_abort_releases_everything(model, oracle):
    s = session(model, oracle)
    s.apply(Submit("a", BASE[:13], 3))
    s.apply(Step(5))
    s.apply(Abort("a"))
    view = s.impl.view()
    assert all(n == 0 for n in view.kv_refcounts.values())
    assert all(n == 0 for n in view.state_refcounts.values())


class _Scripted(ReferenceCache):
    """Breaks the contract in one named way."""

    how = ""

    def schedule(self, budget):
        plan = super().schedule(budget)
        if self.how == "skip" and plan.requests and plan.requests[0].start > 0:
            rs = plan.requests[0]  # a later step that skips a token (a first step may claim a hit)
            return StepPlan((RequestStep(rs.request_id, rs.start + 1, rs.end, rs.block_table, rs.state_slot,
                                         rs.state_init),))
        if self.how == "bad-block" and plan.requests:
            rs = plan.requests[0]
            return StepPlan((RequestStep(rs.request_id, rs.start, rs.end, (999,), rs.state_slot, rs.state_init),))
        if self.how == "raise":
            raise RuntimeError("boom")
        if self.how == "hang":
            time.sleep(30)
        if self.how == "nothing":
            return StepPlan()
        return plan


@pytest.mark.parametrize("how,kind", [("skip", "contract"), ("bad-block", "contract"), ("nothing", "stall")])
def test_contract_violations_are_failures(model, oracle, how, kind):
    factory = type("Broken", (_Scripted,), {"how": how})
    s = session(model, oracle, factory)
    s.apply(Submit("a", BASE[:9], 1))
    with pytest.raises(ConformanceFailure) as info:
        s.apply(Drain(1024))
    assert info.value.kind == kind


@pytest.mark.parametrize("how,kind", [("raise", "raised"), ("hang", "timeout")])
def test_raise_and_hang_become_findings(model, oracle, how, kind):
    factory = type("Broken", (_Scripted,), {"how": how})
    s = session(model, oracle, factory, timeout=1.0)
    s.apply(Submit("a", BASE[:9], 1))
    started = time.monotonic()
    with pytest.raises(ImplementationError) as info:
        s.apply(Drain(1024))
    assert info.value.kind == kind
    assert time.monotonic() - started < 10


def test_wrong_logits_are_explained(model, oracle):
    class StaleState(ReferenceCache):
        # Resumes a hit from a fresh state: the KV is reused, the state is not.
        def _admit(self, req, kv_copies):
            ok = super()._admit(req, kv_copies)
            if ok and req.init.kind == "copy":
                from conformance.contract import FRESH
                req.init = FRESH
            return ok

    s = session(model, oracle, StaleState)
    s.apply(Submit("a", BASE[:9], 1))
    s.apply(Drain(1024))
    s.apply(Submit("b", BASE[:9] + (3, 3), 1))
    with pytest.raises(ConformanceFailure) as info:
        s.apply(Drain(1024))
    assert info.value.kind == "logits"
    assert "state slot" in str(info.value) and "wanted" in str(info.value)


def test_a_re_admission_is_judged_on_the_state_it_starts_from(model, oracle):
    """A later step may start past the computed tokens only from a state that
    memory shows is the state at its start: the running slot for RESUME (a
    correct cache whose slot already holds it, as vLLM's preempt-and-resume
    may), the source of a copy, followed through the plan's own state copies;
    never FRESH, never a slot holding a shorter or another sequence's state."""
    from conformance.contract import FRESH, RESUME, copy_from

    s = session(model, oracle)
    mem = s.runner.memory
    tokens = BASE[:16]
    mem.mark_state(3, tokens[:12])  # the state at 12 of this sequence
    mem.mark_state(4, tokens[:8])  # a shorter one
    mem.mark_state(5, (7,) * 12)  # another sequence's
    table = (0, 1, 2, 6)

    def readmitted(slot, init, copies=()):
        rs = RequestStep("r", 12, 16, table, slot, init)
        return s._readmitted(StepPlan((rs,), state_copies=copies), rs, tokens)

    assert readmitted(3, RESUME)  # the running slot holds the state at 12
    assert readmitted(7, copy_from(3))  # a copy of a slot that holds it
    assert readmitted(7, RESUME, copies=((3, 7),))  # the plan's copy lands it first
    assert readmitted(7, copy_from(8), copies=((3, 8),))  # a copy of a copy
    assert readmitted(7, RESUME, copies=((3, 8), (8, 7)))  # a chain of the plan's copies, in their order
    assert not readmitted(7, RESUME, copies=((3, 7), (5, 7)))  # the second copy onto 7 is what it holds
    assert readmitted(11, copy_from(3, ("ssm",)), copies=((3, 11),))  # the conv kept is the one copied first
    assert not readmitted(3, FRESH)  # zeroes are the state at 0 only
    assert not readmitted(4, RESUME)  # a skip: the slot is at 8
    assert not readmitted(7, copy_from(5))  # another sequence's state of the same length
    assert not readmitted(7, RESUME)  # never written
    mem.mark_state(9, tokens[:12])
    mem.copy_state(4, 9, conv=True, ssm=False)  # conv at 8, matrix at 12: not the state at 12
    assert not readmitted(9, RESUME)
    assert not readmitted(10, copy_from(3, ("ssm",)))  # the matrix copied; slot 10's conv never written
