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
        if ev.get("event") == "plan":
            for r in ev["requests"]:
                if r["request_id"] == rid:
                    return r["start"]
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
