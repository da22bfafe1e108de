"""The exported state machine: it takes the implementation in its
constructor, runs under Hypothesis's own runner, and its verdicts come from
the session's checkers (a crashing checker is a harness error, never a pass)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.adapters.reference import ReferenceCache
from conformance.errors import ConformanceFailure, HarnessError
from conformance.generate.machine import HybridCacheMachine, Recorder
from conformance.harness.checker import Checker
from conformance.suite.checks import get_check
from fault_injection.catalog import get_mutant

FAST = settings(max_examples=8, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck),
                database=None)


def test_the_machine_takes_the_implementation(model, oracle):
    recorder = Recorder()
    spec = get_check("mid-block-hits")
    run_state_machine_as_test(lambda: HybridCacheMachine(ReferenceCache, spec, model=model, oracle=oracle,
                                                         recorder=recorder), settings=FAST)
    assert recorder.examples >= 8 and recorder.coverage["requests"] > 0


def test_one_bound_class_per_configuration(model):
    spec = get_check("mid-block-hits")
    a = HybridCacheMachine(ReferenceCache, spec, model=model)
    b = HybridCacheMachine(ReferenceCache, spec, model=model)
    c = HybridCacheMachine(ReferenceCache, get_check("eviction-pressure"), model=model)
    assert type(a) is type(b) and type(a) is not type(c) and isinstance(a, HybridCacheMachine)
    assert type(a).conf.B == spec.block_size


def test_a_mutant_fails_through_the_machine(model, oracle):
    buggy = get_mutant("hit-off-by-one").wrap(ReferenceCache)
    with pytest.raises(ConformanceFailure):
        run_state_machine_as_test(lambda: HybridCacheMachine(buggy, get_check("mid-block-hits"), model=model,
                                                             oracle=oracle),
                                  settings=settings(FAST, max_examples=60, phases=[p for p in FAST.phases
                                                                                   if p.name != "shrink"]))


class Crashing(Checker):
    name = "crashing"

    def computed(self, obs, executed):
        raise ZeroDivisionError("a checker bug")


def test_a_crashing_checker_is_a_harness_error(model, oracle):
    def attach(session):
        session.add_checker(Crashing())

    with pytest.raises(HarnessError, match="checker 'crashing' crashed in computed"):
        run_state_machine_as_test(lambda: HybridCacheMachine(ReferenceCache, get_check("mid-block-hits"),
                                                             model=model, oracle=oracle, attach=attach),
                                  settings=settings(FAST, phases=[p for p in FAST.phases if p.name != "shrink"]))


BASES = (tuple(range(1, 25)), tuple(range(30, 54)), tuple(range(40, 64)))


def started(spec_id, model, oracle, monkeypatch):
    """A machine whose rules are called by hand (outside Hypothesis: no notes)."""
    monkeypatch.setattr("conformance.generate.rules.base.note", lambda text: None)
    m = HybridCacheMachine(ReferenceCache, get_check(spec_id), model=model, oracle=oracle)
    m.start(BASES)
    return m


def test_a_burst_apart_continues_each_copy_with_its_own_token(model, oracle, monkeypatch):
    """Apart, the copies share the cold prefix and then differ, each for at
    least a block: a cache that defers a request whose hit another request
    caches in the same step (vLLM) still starts them together, cold."""
    m = started("hard-prefixes", model, oracle, monkeypatch)
    m._submit_if_fits(BASES[1][:9], 1)
    m._submit_if_fits(BASES[2][:9], 1)  # two of three request slots taken: the burst steps first
    m.same_prefix_burst(base=0, cut=8, copies=3, suffix=(5,) * 5, ends=[0, 1, 5])  # the last length odd: apart
    prompts = [t.tokens[: t.prompt_len] for rid, t in m.session.tracks.items() if rid not in ("r1", "r2")]
    prefix = BASES[0][:8] + (5,) * 5
    assert len(prompts) == 3 and all(p[: len(prefix)] == prefix for p in prompts)
    assert len({p[len(prefix)] for p in prompts}) == 3 and min(len(p) for p in prompts) >= len(prefix) + 1 + 4
    assert m.session.coverage["same_step_cold_prefills"] == 1


def test_a_decode_abort_picks_a_request_that_can_decode(model, oracle, monkeypatch):
    """A request that asked for one token finishes as its prefill ends: the
    mid-decode abort goes to one that asked for more."""
    m = started("pressure-while-running", model, oracle, monkeypatch)
    m._submit_if_fits(BASES[1][:9], 1)
    m._submit_if_fits(BASES[2][:9], 3)
    m.abort_running(which=0, decode=True, budget=1)
    assert m.session.coverage["aborts_mid_decode"] == 1
