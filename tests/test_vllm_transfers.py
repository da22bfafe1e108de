"""vLLM's asynchronous-load path under the harness's transfer decisions
(issue 14): the store connector's loads stay pending across steps while the
harness holds them, the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``,
and each decision (deliver late, out of order, failed, short; the host entry
evicted after the lookup; an abort meanwhile) reaches vLLM's own scheduler
through ``finished_recving`` / ``failed_recving``.  What is asserted about a
load is read from the harness (its transport's pending list, memory's
provenance), never from the connector's account of itself.

Runs only where vLLM is installed (see docs/vllm-adapter.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")

from vllm.v1.request import RequestStatus  # noqa: E402

from conformance.adapters.vllm import VllmCache  # noqa: E402
from conformance.contract import ImplConfig  # noqa: E402
from conformance.errors import ConformanceFailure  # noqa: E402
from conformance.generate.probe_sizing import pool_probe  # noqa: E402
from conformance.harness.history import Planned  # noqa: E402
from conformance.harness.ops import Abort, Deliver, Drain, HoldTransfers, Step, StoreEvict, Submit  # noqa: E402
from conformance.judge import judged_session  # noqa: E402

B = 4
PROMPT = (7, 3, 41, 19, 22, 5, 60, 33, 12, 9, 50, 27, 31, 44)  # 14 tokens: vLLM's checkpoint at 12
JUNK = [tuple((17 * i + 5 * k) % 61 + 1 for k in range(31)) for i in range(1, 4)]  # turns the pool over


def _session(model, oracle, connector="async"):
    # the tier-races check's pool; MambaMixer2's spec, vLLM's default match unit
    config = ImplConfig(block_size=B, num_kv_blocks=28, num_state_slots=10, options={"connector": connector})
    return judged_session(VllmCache, config, model, oracle, families=("expected-hit",))


def _reload(s) -> None:
    """PROMPT computed (its checkpoint at 12 exported from inside the step and
    offloaded), displaced locally by the junk, asked for again: vLLM offers 0,
    the store claims 12, and the loads are issued and held."""
    for op in [HoldTransfers(), Submit("p", PROMPT, 1), Drain(1024)]:
        s.apply(op)
    for i, junk in enumerate(JUNK):
        s.apply(Submit(f"j{i}", junk, 1))
        s.apply(Drain(1024))
    s.apply(Submit("q", PROMPT, 1))
    s.apply(Step(1))


def _first_start(s, rid: str) -> int | None:
    for ev in s.history.events:
        if isinstance(ev, Planned):
            for r in ev.plan.requests:
                if r.request_id == rid:
                    return r.start
    return None


def test_loads_stay_pending_until_the_harness_decides(model, oracle):
    s = _session(model, oracle)
    _reload(s)
    pending = s.pending_loads()
    assert ("q", 0, 12) in s.impl.connector.log
    assert sorted((t.kind, t.request_id) for t in pending) == [("kv", "q")] * 3 + [("state", "q")]
    request = s.impl.scheduler.requests["q"]
    mem = s.runner.memory
    kv = [t.device for t in pending if t.kind == "kv"]
    # memory: nothing of PROMPT has landed in the destinations yet
    assert all(mem.kv_prov[b][-1] != PROMPT[: (i + 1) * B] for i, b in enumerate(kv))
    s.apply(Deliver(0, "ok", 2))  # one KV block lands two steps late, the rest at the next step
    for _ in range(3):
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and _first_start(s, "q") is None
        s.apply(Step(1))
    assert not s.pending_loads()
    # memory: the loads wrote PROMPT's blocks and the state after 12 tokens
    assert [mem.kv_prov[b][-1] for b in kv] == [PROMPT[: (i + 1) * B] for i in range(3)]
    s.apply(Drain(1024))
    assert _first_start(s, "q") == 12, "vLLM must resume from the loaded 12 tokens"
    assert s.control.counts["delayed"] == 1 and s.impl.connector.stats["failed_loads"] == 0
    assert not s.active() and s.idle()


def _pick(s, kind: str) -> int:
    """The index (for ``Deliver``/``StoreEvict``) of a pending load of ``kind``
    whose destination does not already hold the bytes it brings (memory can
    tell): a short write onto the same bytes would land whole."""
    mem, pending = s.runner.memory, s.pending_loads()
    for i, t in enumerate(pending):
        entry = s.runner.transport.store.get(t.key)
        held = mem.kv_prov[t.device] if t.kind == "kv" else mem.ssm_prov[t.device]
        if t.kind == kind and entry is not None and held != entry.payload.prov[kind if kind == "kv" else "ssm"]:
            return i
    raise AssertionError(f"no pending {kind} load to decide: {pending}")


@pytest.mark.parametrize("decide, broken", [
    (lambda s: [Deliver(_pick(s, "kv"), "fail")], True),
    (lambda s: [Deliver(_pick(s, "state"), "short")], True),  # the state arrives without its matrix part
    (lambda s: [Deliver(_pick(s, "kv"), "short")], True),  # a KV block arrives half written
    (lambda s: [StoreEvict(_pick(s, "state"))], True),  # the host entry is gone when the load reads it
    (lambda s: [Deliver(len(s.pending_loads()) - 1, "ok"), Deliver(0, "ok")], False),  # the last reported first
], ids=["fail", "short-state", "short-kv", "store-evict", "out-of-order"])
@pytest.mark.parametrize("connector", ["async", "divergent"])
def test_each_decision_reaches_vllms_scheduler(model, oracle, decide, broken, connector):
    """A broken load is reported in ``failed_recving`` and vLLM recomputes
    the request from 0 (``kv_load_failure_policy="recompute"``); whole loads,
    in any order, let it resume from the loaded 12.  Logits, invariants and the
    expected-hit oracle judge every step."""
    s = _session(model, oracle, connector)
    _reload(s)
    for op in decide(s):
        s.apply(op)
    s.apply(Drain(1024))
    counts = s.control.counts
    assert _first_start(s, "q") == (0 if broken else 12)
    assert s.impl.connector.stats["failed_loads"] == int(broken)
    assert counts["failed"] + counts["short"] + counts["store_evicted"] == int(broken)
    if not broken:
        assert counts["reordered"] == 1
    assert not s.active() and s.idle() and not s.impl.scheduler.requests


def test_abort_while_the_load_is_held(model, oracle):
    """vLLM keeps an aborted request's blocks until its held load is reported
    (``Scheduler.finish_requests`` on WAITING_FOR_REMOTE_KVS); the late report
    frees them and nothing leaks."""
    s = _session(model, oracle)
    _reload(s)
    s.apply(Deliver(1, "ok", 1))
    s.apply(Abort("q"))
    assert s.pending_loads(), "the held loads outlive the abort"
    s.apply(Submit("z", (60, 61, 62, 63, 1), 1))
    for _ in range(3):  # one token a step: the late load lands while z runs
        s.apply(Step(1))
    s.apply(Drain(1024))
    assert not s.pending_loads() and not s.impl.scheduler.requests
    view = s.impl.view()
    assert all(n == 0 for n in view.kv_refcounts.values()), view.kv_refcounts


def test_the_pool_probe_starts_after_a_held_load_of_an_aborted_request_lands(model, oracle):
    """The held load outlives the abort and the drain (no request is active):
    vLLM frees the request's blocks only when the load is reported (the next
    step's ``finished_recving``), so the probe lands it before it measures,
    and finds nothing leaked (seed 1's tier-races false positive: 9 of 28
    short requests scheduled where a fresh instance schedules 13)."""
    s = _session(model, oracle)
    _reload(s)
    s.apply(Abort("q"))
    assert s.pending_loads() and not s.active(), "the held loads outlive the abort"
    config = ImplConfig(block_size=B, num_kv_blocks=28, num_state_slots=10, options={"connector": "async"})
    probe = pool_probe(VllmCache, config, model, oracle)
    assert probe is not None and probe.concurrent
    s.apply(probe)  # raises ConformanceFailure("invariant", "lifetime: ...") on a leak
    assert not s.pending_loads()


def test_blocks_vllm_registers_when_it_schedules_them_are_not_held_for_that_request(model, oracle):
    """vLLM registers a block in its prefix cache when it allocates it for a
    step (the view after schedule() lists the request's own prompt, content
    not written yet); the expected-hit oracle took that for a device hold
    combined with the host tier and failed a fresh prompt's first step
    ("reused 0 tokens, but a correct cache could reuse 28"), on every
    tier-races variant.  What the device held is what the views before and
    after the schedule both list."""
    s = _session(model, oracle)
    fresh = tuple((5 * k + 3) % 61 + 1 for k in range(31))
    for op in [Submit("p", PROMPT, 2), Drain(1), Submit("r", fresh, 1), Drain(1024)]:
        s.apply(op)
    assert not s.active() and s.idle() and _first_start(s, "r") == 0
    assert s.coverage.get("remote_expected", 0) == 0


def _hit_rate_failure(s, ops) -> str:
    with pytest.raises(ConformanceFailure) as exc:
        for op in ops:
            s.apply(op)
    assert exc.value.kind == "hit-rate"
    return str(exc.value)


def test_vllm_cannot_join_a_device_kv_hit_with_a_host_state(model, oracle):
    """vLLM finding (hit rate, logits right; tier-races[connector=async]'s
    repro): the device caches r7's block [0, 4) (r5 recomputed it after its
    load of the host copy failed) but no state at 4; the host tier holds the
    state at 4 and no trusted copy of the block.  vLLM offers the connector
    the local hit every group agrees on (0) and takes the external tokens as
    one suffix loaded into new blocks (scheduler.py:1129-1142,
    kv_cache_manager.py:455-473), so the device's block cannot be combined
    with the host's state: r7 recomputes 4 tokens the two tiers hold."""
    a = (18, 29, 27, 63, 44, 44, 23, 20, 3, 37, 26, 27, 28, 40)
    junk = [(7, 21, 52, 40, 20, 52, 16, 49, 20, 57, 10, 11, 49, 26, 1, 29, 32, 36, 2, 2, 38, 47, 34, 41, 13, 24, 28,
             24, 32, 15, 43),
            (55, 3, 4, 46, 40, 32, 13, 39, 40, 48, 10, 0, 38, 0, 39, 50, 17, 1, 11, 53, 38, 26, 45, 10, 39, 48, 33,
             55, 2, 57, 18),
            (15, 45, 18, 42, 59, 4, 45, 6, 7, 18, 44, 16, 11, 54, 26, 57, 24, 15, 6, 56, 44, 31, 63, 39, 27, 54, 52,
             3, 48, 38, 16)]
    s = _session(model, oracle, "async")
    ops = [HoldTransfers(), Submit("r1", a, 3), Drain(1)] + [Submit(f"r{i + 2}", j, 1) for i, j in enumerate(junk)]
    ops += [Drain(1024), Submit("r5", a, 1), Step(1), Deliver(0, "fail"), Step(5), Step(1024),
            Submit("r7", a[:5], 2), Step(16)]
    message = _hit_rate_failure(s, ops)
    assert "request r7 reused 0 tokens, but a correct cache could reuse 4 (device 0, host tier 4" in message
    assert s.impl.connector.log[-1] == ("r7", 0, 0)


def test_the_divergent_path_drops_a_host_state_below_its_attention_hit(model, oracle):
    """vLLM finding (hit rate; tier-races[connector=divergent]'s repro): r8's
    attention hit (16) runs deeper than its Mamba hit (12); the divergent
    path offers the connector 16, the store holds the state at 16 but nothing
    past it below r8's 18 tokens, so the connector claims 0 and vLLM falls
    back to the common boundary (scheduler.py:1199-1209) without asking from
    there: r8 reuses 12 while the two tiers hold 16."""
    a = (25, 26, 25, 5, 24, 57, 51, 45, 36, 33, 57, 53, 36, 13, 1, 62)
    s = _session(model, oracle, "divergent")
    message = _hit_rate_failure(s, [Submit("r1", a, 1), Submit("r2", a[:5], 1), Drain(1024),
                                    Submit("r8", a + (59, 14), 3), Drain(1)])
    assert "request r8 reused 12 tokens, but a correct cache could reuse 16 (device 12, host tier 16" in message
    assert s.impl.connector.log[-1] == ("r8", 16, 0)


@pytest.mark.parametrize("connector", ["async", "divergent"])
@pytest.mark.parametrize("evict_kv", [False, True])
def test_tier_tail_reaches_the_host_tier_over_a_local_hit(machine, connector, evict_kv):
    """tier-reuse's tier-tail history on vLLM's store connector: the host tier
    holds a state at block k's end only when a step ended there (the prompt up
    to that block runs on its own), and the divergent path takes it only once
    the device's KV stops short of it (evict_kv).  Without the block-end
    prompt vLLM never met tier_hits_over_local; without evict_kv the divergent
    path never does (measured over draws 0-5, both: 0 of 6)."""
    m = machine("tier-reuse", VllmCache, connector=connector)
    m.remote_beats_local_tail(0, 28, 3, 1, 1, evict_kv=evict_kv)
    reached = m.session.coverage["tier_hits_over_local"]
    assert reached == (1 if evict_kv or connector == "async" else 0), m.session.coverage
