"""vLLM's own offloading connector as the second tier (``--option connector=offload-lru|offload-arc``):
vLLM's real Scheduler and OffloadingConnector (both roles) over its real CPUOffloadingManager, the
harness as the worker (conformance/adapters/vllm/offloading.py), driven through the Session with
hand-written sequences written for no mutant in particular.

Runs only where vLLM is installed (``.venvs/main``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")

from drive import session_of  # noqa: E402

from conformance.adapters.vllm import VllmCache  # noqa: E402
from conformance.adapters.vllm.config import VllmOptions  # noqa: E402
from conformance.contract import ImplConfig  # noqa: E402
from conformance.errors import ConformanceFailure, ImplementationError  # noqa: E402
from conformance.harness.ops import Drain, Step, Submit  # noqa: E402
from fault_injection.vllm_offload_mutants import OPTIONS, VLLM_OFFLOAD_MUTANTS  # noqa: E402

B = 4
PROMPT = tuple((7 * i + 3) % 60 + 1 for i in range(16))


def junk(j: int, n: int = 17) -> tuple[int, ...]:
    return tuple((11 * i + 5 * j + 2) % 60 + 1 for i in range(n))


def make(model, oracle, policy="lru", num_blocks=14, mutant=None, num_state_slots=None, **options):
    impl = VllmCache(ImplConfig(block_size=B, num_kv_blocks=num_blocks, num_state_slots=num_state_slots or num_blocks,
                                options={"connector": f"offload-{policy}", **options}))
    if mutant is not None:
        impl = VLLM_OFFLOAD_MUTANTS[mutant](impl)
    return session_of(impl, model, oracle)


def reload_after_displacement(prompt=PROMPT, more=(5, 6)):
    """A prompt, others that displace it from a small pool, then the prompt extended: what comes back
    comes back from the CPU tier."""
    ops = [Submit("a", prompt, 1), Drain(64), Submit("c", junk(9, 20), 1), Drain(64)]
    for j in range(3):
        ops += [Submit(f"j{j}", junk(j), 1), Drain(64)]
    return ops + [Submit("b", prompt + more, 2), Drain(64)]


def test_the_tier_is_vllms_own_connector_and_manager(model, oracle):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    for policy, cls in (("lru", "LRUCachePolicy"), ("arc", "ARCCachePolicy")):
        impl = make(model, oracle, policy).impl
        tier = impl.connector
        assert isinstance(impl.scheduler.connector, OffloadingConnector)
        assert isinstance(tier.worker_connector, OffloadingConnector)
        assert type(tier.manager) is CPUOffloadingManager
        assert type(tier.manager._policy).__name__ == cls
        assert impl.retention()["tier_unit"] == B and impl.retention()["tier_losses"] is False
        assert impl.defect_facts(impl.config)["offload"] == policy


def test_offload_names_a_tier_in_the_connector_slot():
    o = VllmOptions.from_config(ImplConfig(block_size=B, options={"connector": "offload-arc"}))
    assert o.offload == "arc" and o.connector is None
    with pytest.raises(ValueError, match="offload-lru"):
        VllmOptions.from_config(ImplConfig(block_size=B, options={"connector": "offload-fifo"}))
    sized = VllmOptions.from_config(ImplConfig(block_size=B, options={"connector": "offload-lru", "offload_chunks": 8}))
    assert sized.offload_chunks == 8
    with pytest.raises(ValueError, match="offload_chunks"):
        VllmOptions.from_config(ImplConfig(block_size=B, options={"connector": "async", "offload_chunks": 8}))


@pytest.mark.parametrize("retention_interval", [0, None])
def test_a_displaced_prompt_comes_back_from_the_cpu_tier(model, oracle, retention_interval):
    s = make(model, oracle, retention_interval=retention_interval)
    for op in reload_after_displacement():
        s.apply(op)
    tier = s.impl.connector
    assert s.coverage["tier_loads"] > 0 and s.coverage["tier_hits"] > 0
    assert tier.stats["store_jobs"] > 0 and tier.stats["load_jobs"] > 0
    assert tier.stats["flushed"] > 0  # stores of finished requests' reused blocks, waited for before the step
    assert tier.stats["host_evictions"] == 0  # the oracle reads the harness's store (offloading.host_chunks)


def test_a_failed_load_stops_vllms_worker(model, oracle):
    """vLLM 0.33 has no path for a failed job (the known limitation offload-no-loss-path): the harness
    reports the failure as the wire did, and vLLM's own assertion stops the step."""
    from fault_injection.environment import build_faults

    s = make(model, oracle)
    build_faults(("transfer-fail:p=1",), 0).attach(s)
    with pytest.raises(ImplementationError, match="AssertionError"):
        for op in reload_after_displacement():
            s.apply(op)


def test_the_mamba_clamp_mutant_is_caught_by_a_generic_sequence(model, oracle):
    """A 14-token prompt caches its tail state (12) in the CPU tier; its first 12 tokens are asked
    for after the device let them go: reverted, vLLM hits 11 tokens and loads the state after 12."""
    prompt = PROMPT[:14]
    ops = [Submit("a", prompt, 1), Drain(64)]
    for j in range(4):
        ops += [Submit(f"j{j}", junk(j), 1), Drain(64)]
    ops += [Submit("b", prompt[:12], 2), Drain(64)]
    s = make(model, oracle, num_blocks=24)
    for op in ops:
        s.apply(op)
    s = make(model, oracle, num_blocks=24, mutant="vllm-offload-mamba-clamp-reverted")
    with pytest.raises(ConformanceFailure) as caught:
        for op in ops:
            s.apply(op)
    assert caught.value.kind == "logits"


def turn_over(seed=3):
    """A turn-over history (conformance/generate/rules/turnover.py's shape), as the suite minimized
    one: a request that keeps decoding, then two long prompts at once; the first finishes in its only
    step, the second waits for room and its allocations take the first's freshly freed blocks in the
    next step."""
    import random

    rng = random.Random(seed)
    prompt = lambda n: tuple(rng.randrange(1, 64) for _ in range(n))  # noqa: E731
    return [Submit("q", prompt(27), 5), Step(64), Submit("r", prompt(29), 1), Submit("s", prompt(31), 1),
            Drain(1024)]


@pytest.mark.parametrize("mutant", ["vllm-offload-store-fence-dropped", "vllm-offload-finished-store-fence-dropped"])
def test_the_store_fence_mutants_are_caught_by_the_host_listing_judge(model, oracle, mutant):
    """vLLM waits for a store whose block it hands out again (jobs_to_flush); without the fence the
    copy reads the block's new owner and the CPU tier publishes it under the old key: the view's
    host listing, judged against the store's provenance, says so when the chunk becomes ready."""
    s = make(model, oracle, num_blocks=28, num_state_slots=10)
    for op in turn_over():
        s.apply(op)
    assert s.impl.connector.stats["flushed"] > 0 and s.coverage["host_entries_judged"] > 0
    s = make(model, oracle, num_blocks=28, num_state_slots=10, mutant=mutant)
    with pytest.raises(ConformanceFailure) as caught:
        for op in turn_over():
            s.apply(op)
    assert caught.value.kind == "invariant" and "host entry" in str(caught.value)


def test_offload_mutants_are_registered_for_the_tier_family():
    from fault_injection.catalog import all_mutants

    registered = all_mutants()
    for name in VLLM_OFFLOAD_MUTANTS:
        m = registered[name]
        assert m.target == "vllm" and m.family == "tier" and dict(m.options)["connector"] == "offload-lru"
        assert m.description and dict(m.options) == OPTIONS[name]


def test_window_groups_go_through_vllms_tier():
    """The window family's model (two SlidingWindowSpec groups beside Mamba and full attention): vLLM's
    offloading scheduler stores the window groups' chunks, and brings them back with the rest; each copy
    lands in its window group's memory (Transfer.window_group), and every logit and window read is right."""
    from conformance.harness.oracle import Oracle
    from conformance.model import ModelConfig, TinyHybrid

    config = ModelConfig.fixture("window-hybrid")
    model = TinyHybrid(config)
    impl = VllmCache(ImplConfig(block_size=B, num_kv_blocks=48, num_state_slots=48,
                                options={"connector": "offload-lru"}, **config.window_facts()))
    s = session_of(impl, model, Oracle(model))
    seen = []
    take = impl.connector.worker.take

    def taken():
        out = take()
        seen.extend(out)
        return out

    impl.connector.worker.take = taken
    ops = [Submit("a", PROMPT, 1), Drain(64)]
    for j in range(5):
        ops += [Submit(f"j{j}", junk(j, 20), 1), Drain(64)]
    for op in ops + [Submit("b", PROMPT + (5, 6), 2), Drain(64)]:
        s.apply(op)
    for direction in ("offload", "load"):
        assert {t.window_group for t in seen if t.direction == direction and t.kind == "kv"} == {None, 0, 1}
    assert s.coverage["tier_loads"] > 0 and s.coverage["tier_hits"] > 0


def test_the_window_candidates_name_their_fix_and_extra_retained_needs_multi_module_mtp(model, oracle):
    from fault_injection.vllm_offload_mutants import CANDIDATES

    for name, fix in (("vllm-offload-window-stale-blocks-kept", "42959"),
                      ("vllm-offload-window-final-tail-dropped", "48911"),
                      ("vllm-offload-window-extra-retained-dropped", "56709")):
        assert CANDIDATES[name].__doc__.startswith(f"TIER: vllm#{fix} reverted.")
    # extra_retained_tokens is max(0, num_prefill_lookahead_tokens - 1): 0 without multi-module MTP
    impl = make(model, oracle).impl
    with pytest.raises(TypeError, match="multi-module MTP"):
        CANDIDATES["vllm-offload-window-extra-retained-dropped"](impl)


def test_the_matrix_runs_vllms_tier_over_window_groups_and_kda():
    from conformance.adapters.vllm.adapter import OFFLOAD_VARIANTS

    window = {"connector": "offload-lru", "model": "window-hybrid", "num_kv_blocks": 48}
    assert window in OFFLOAD_VARIANTS["tier-reuse"] and window in OFFLOAD_VARIANTS["tier-races"]
    assert {"connector": "offload-lru", "layer": "kda"} in OFFLOAD_VARIANTS["tier-races"]
