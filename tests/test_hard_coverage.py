"""The hard-history counters count the situation their names promise
(conformance/judge/hard_coverage.py), whatever order the tracks are in and
whatever the view says about slots the step itself uses."""

from types import SimpleNamespace

from conformance.contract import CachedState, CacheView, Layout, Request, RequestStep, StepPlan, copy_from
from conformance.harness.checker import Scheduled, Submitted
from conformance.harness.session import Track
from conformance.judge.hard_coverage import HardHistoryCoverage

B = 4


def fake_session(tracks: dict[str, Track]):
    """What a checker observes of a session (conformance.harness.observation)."""
    obs = SimpleNamespace(layout=Layout(B, 16, 8), tracks=tracks, evicted=0, store=SimpleNamespace(entries={}),
                          last_view=None, probing=False)
    obs.pending_loads = lambda: []
    return obs


def pressure_after(state_refcounts: dict[int, int]) -> int:
    """One new request hits the snapshot in slot 2 and extends slot 3."""
    session = fake_session({"r": Track(tuple(range(9)), 9, 1, None)})
    counter = HardHistoryCoverage()
    counter.attached(session)
    plan = StepPlan(requests=(RequestStep("r", 4, 9, (0, 1, 2), 3, copy_from(2)),))
    view = CacheView(state_refcounts=state_refcounts,
                     cached_states=(CachedState(2, tuple(range(4))), CachedState(4, (7,))))
    counter.scheduled(session, Scheduled(plan, view))
    return counter.coverage["snapshot_hits_under_slot_pressure"]


def test_slot_pressure_counts_only_free_slots():
    # free: unreferenced and holding no cached snapshot (4 holds one): 0 and 1
    assert pressure_after({0: 0, 1: 0, 2: 1, 3: 1, 4: 0}) == 0
    assert pressure_after({0: 0, 1: 1, 2: 1, 3: 1, 4: 0}) == 1


def test_a_slot_the_step_uses_is_not_free_whatever_the_view_says():
    # slot 3 is the request's running slot: stated free, it is not counted free
    assert pressure_after({0: 0, 2: 1, 3: 0, 4: 0}) == 1


def test_a_tail_divergence_counts_whichever_sequence_comes_first():
    long = tuple(range(1, 13))  # 12 tokens: no partial tail
    short = long[:10]  # a partial tail of two tokens: 8, 9
    for order in ((long, short), (short, long)):
        tracks = {f"t{i}": Track(seq, len(seq), 1, None) for i, seq in enumerate(order)}
        session = fake_session(tracks)
        counter = HardHistoryCoverage()
        counter.attached(session)
        prompt = short[:9] + (60, 61)  # one token into the short sequence's partial tail
        tracks["new"] = Track(prompt, len(prompt), 1, None)
        counter.submitted(session, Submitted(Request("new", prompt)))
        assert counter.coverage["in_block_divergences"] == 1
        assert counter.coverage["tail_divergences"] == 1, order
