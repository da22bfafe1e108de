"""The structural invariants: what the implementation states against what
memory holds."""

from conformance.contract import CachedKV, CachedState, CacheView, Layout, RequestStep, StepPlan
from conformance.harness.memory import Memory
from conformance.judge.invariants import check_tables_referenced, check_view
from conformance.model import ModelConfig

LAYOUT = Layout(block_size=4, num_kv_blocks=4, num_state_slots=2)


def _memory():
    mem = Memory(LAYOUT, ModelConfig())
    mem.kv_prov[1] = [(7,), (7, 8), (7, 8, 9), None]
    mem.conv_prov[0] = mem.ssm_prov[0] = (7, 8, 9)
    return mem


def test_an_honest_view_has_no_problems():
    view = CacheView(kv_refcounts={1: 1}, state_refcounts={0: 0}, cached_kv=(CachedKV(1, (7, 8, 9)),),
                     cached_states=(CachedState(0, (7, 8, 9)),))
    assert check_view(view, _memory(), idle=False) == []


def test_cached_entries_must_hold_what_they_are_registered_for():
    view = CacheView(cached_kv=(CachedKV(1, (7, 8, 9, 10)),), cached_states=(CachedState(0, (7, 8)),))
    problems = check_view(view, _memory(), idle=False)
    assert any("KV block 1" in p and "never-written" in p for p in problems)
    assert any("state slot 0" in p and "written after the prefix ended" in p for p in problems)


def test_refcounts_are_bounded_non_negative_and_zero_at_idle():
    view = CacheView(kv_refcounts={9: 1, 2: -1, 1: 2})
    problems = check_view(view, _memory(), idle=True)
    assert any("outside the layout" in p for p in problems)
    assert any("refcount -1" in p for p in problems)
    assert any("leaked" in p for p in problems)


def test_a_scheduled_table_must_be_referenced():
    plan = StepPlan((RequestStep("a", 0, 6, (1, 3), 0),))
    assert check_tables_referenced(CacheView(kv_refcounts={1: 1, 3: 1}), plan, 4) == []
    problems = check_tables_referenced(CacheView(kv_refcounts={1: 1, 3: 0}), plan, 4)
    assert problems and "KV block 3" in problems[0]


def _store():
    from conformance.harness.transport import HostEntry, HostStore, Payload

    store = HostStore()
    kv = Payload("kv", {}, {"kv": [(7, 8, 9, 10, 11), (7, 8, 9, 10, 11, 12), None, None]})
    store.put("kv", HostEntry(kv, "c"))
    store.put("state", HostEntry(Payload("state", {}, {"conv": (7, 8), "ssm": (7, 8)}), "c"))
    store.put("broken", HostEntry(Payload("state", {}, {"conv": (1,), "ssm": (1,)}), "c", intact=False))
    return store


def test_host_listings_are_judged_against_the_store_they_name():
    from conformance.contract import HostCached
    from conformance.judge.invariants import check_host_view

    honest = CacheView(host_cached=(HostCached("kv", (7, 8, 9, 10, 11, 12)), HostCached("state", (7, 8), "state"),
                                    HostCached("gone", (1, 2), "state"), HostCached("broken", (7, 8), "state")))
    # a key the store lost (an environment fault) and bytes broken on the wire are not the listing's fault
    assert check_host_view(honest, _store(), 4) == []
    wrong = CacheView(host_cached=(HostCached("kv", (7, 8, 9, 10, 11, 13)), HostCached("state", (7, 8, 9), "state"),
                                   HostCached("kv", (7, 8, 9, 10, 11, 12), "kv", 0)))
    problems = check_host_view(wrong, _store(), 4)
    assert any("host entry kv" in p and "position 5 holds content of another" in p for p in problems)
    assert any("host entry state" in p and "state after 2 tokens of the same sequence" in p for p in problems)
    assert any("window group 0's KV but holds full attention KV" in p for p in problems)


def test_a_host_entry_found_right_is_not_judged_again_until_the_store_replaces_it():
    from conformance.contract import HostCached
    from conformance.harness.transport import HostEntry, Payload
    from conformance.judge.invariants import check_host_view

    store, judged = _store(), {}
    view = CacheView(host_cached=(HostCached("state", (7, 8), "state"),))
    assert check_host_view(view, store, 4, judged) == [] and set(judged) == {"state"}
    store.put("state", HostEntry(Payload("state", {}, {"conv": (9,), "ssm": (9,)}), "c"))  # another offload
    assert check_host_view(view, store, 4, judged)


def test_a_tier_that_lists_nothing_is_noted_not_passed_silently(model, oracle):
    """A tier that offloads but lists no host entries reads as reduced assurance in the result's notes."""
    from drive import session_of

    from conformance.adapters.reference import ReferenceCache
    from conformance.contract import ImplConfig
    from conformance.harness.ops import Drain, Submit
    from conformance.judge.invariants import NO_HOST_LISTING

    class Silent(ReferenceCache):
        def view(self):
            from dataclasses import replace

            return replace(super().view(), host_cached=())

    for factory, noted in ((ReferenceCache, False), (Silent, True)):
        s = session_of(factory(ImplConfig(num_kv_blocks=6, num_state_slots=4, options={"host_tier": True})),
                       model, oracle)
        for j in range(4):
            s.apply(Submit(f"r{j}", tuple((7 * i + 5 * j) % 60 + 1 for i in range(12)), 1))
            s.apply(Drain(64))
        assert s.runner.transport.succeeded["offload"] > 0
        assert (NO_HOST_LISTING in s.notes) is noted
