"""Coverage counters that mean what their names say (issue 11, item 6): a hit
after an eviction, a hit served by a tier load, a fault firing whose effect
was consumed."""

import random

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig
from conformance.harness.ops import Drain, Submit
from conformance.judge import judged_session
from fault_injection.environment import build_faults

RNG = random.Random(1)
A = tuple(RNG.randrange(64) for _ in range(13))
JUNK = [tuple(RNG.randrange(64) for _ in range(30)) for _ in range(3)]  # turns the 12-block pool over
COUNTED = ("prefix_hits", "hits_after_eviction", "evictions", "tier_hits", "tier_loads")


def session(model, oracle, tier=False, faults=()):
    cfg = ImplConfig(block_size=4, num_kv_blocks=12, num_state_slots=6, options={"host_tier": tier})
    s = judged_session(ReferenceCache, cfg, model, oracle, timeout=10)
    env = build_faults(faults, 0) if faults else None
    if env is not None:
        env.attach(s)
    return s, env


def run(s, rid, prompt):
    s.apply(Submit(rid, prompt, 1))
    s.apply(Drain(1024))


def counts(s):
    return {k: s.coverage[k] for k in COUNTED}


def test_a_hit_counts_after_an_eviction_only(model, oracle):
    s, _ = session(model, oracle)
    run(s, "a", A)
    run(s, "a2", A[:9] + (1, 2))
    assert counts(s) == dict.fromkeys(COUNTED, 0) | {"prefix_hits": 1}  # a hit, but no eviction before it
    for i, junk in enumerate(JUNK):
        run(s, f"j{i}", junk)
    assert s.coverage["evictions"] > 0 and s.coverage["hits_after_eviction"] == 0
    run(s, "b", JUNK[-1][:29] + (3, 4))  # the tail of the last junk is still cached
    assert s.coverage["hits_after_eviction"] == 1 and s.coverage["tier_hits"] == 0


def test_tier_hits_need_a_step_that_reads_loaded_bytes(model, oracle):
    s, _ = session(model, oracle, tier=True)
    run(s, "a", A)
    run(s, "a2", A[:9] + (1, 2))  # a device hit: no load involved
    assert s.coverage["prefix_hits"] == 1 and s.coverage["tier_hits"] == 0
    for i, junk in enumerate(JUNK):
        run(s, f"j{i}", junk)  # A's blocks and snapshots go to the host tier
    run(s, "b", A[:9] + (3, 4, 5))
    assert s.coverage["tier_loads"] > 0 and s.coverage["tier_hits"] == 1


def test_a_fault_counts_once_its_effect_is_consumed(model, oracle):
    s, env = session(model, oracle, tier=True, faults=("transfer-corrupt:p=1",))
    run(s, "a", A)
    for i, junk in enumerate(JUNK):
        run(s, f"j{i}", junk)  # corrupted offloads, never loaded back
    report = env.report()["transfer-corrupt"]
    assert report["fired"] > 0 and report["consumed"] == 0 and not report["exercised"]
    run(s, "b", A[:9] + (3, 4, 5))  # loads them: the reference rejects the bytes and recomputes
    report = env.report()["transfer-corrupt"]
    assert report["consumed"] > 0 and report["exercised"]
    assert s.coverage["tier_hits"] == 0  # it recomputed: no hit was served by a load
