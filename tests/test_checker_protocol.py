"""The checker protocol (conformance/harness/checker.py): a checker folds over
the events a session shows it with a read-only observation, counts its own
coverage and notes, and the session collects them; the session's own facts
(what its views stopped listing) need no checker at all."""

from conformance.adapters.reference import ReferenceCache
from conformance.contract import ImplConfig
from conformance.harness.checker import Checker, Settled, Submitted
from conformance.harness.ops import Drain, Submit
from conformance.harness.session import make_session

CFG = ImplConfig(block_size=4, num_kv_blocks=12, num_state_slots=6)


class CountsSubmissions(Checker):
    name = "counts-submissions"

    def submitted(self, obs, ev: Submitted):
        assert ev.request.request_id in obs.tracks  # the observation is the session's, as it is now
        self.count("submitted")
        self.notes.add("a note")


def traffic(s, n: int = 6) -> None:
    for i in range(n):  # distinct prompts that turn the small pool over
        s.apply(Submit(f"r{i}", tuple((7 * i + j) % 60 + 1 for j in range(13)), 1))
        s.apply(Drain(1024))


def test_the_session_sums_what_its_checkers_counted_and_noted(model, oracle):
    s = make_session(ReferenceCache, CFG, model, oracle, [CountsSubmissions(), CountsSubmissions()])
    traffic(s, 3)
    assert s.coverage == {"submitted": 6} and s.notes == {"a note"}
    assert not hasattr(s.observation, "coverage") and not hasattr(s.observation, "notes")


def test_evictions_are_a_fact_of_the_session_not_of_a_checker(model, oracle):
    s = make_session(ReferenceCache, CFG, model, oracle, [])  # no checker counts anything
    traffic(s)
    assert s.coverage == {} and s.evicted > 0 and s.observation.evicted == s.evicted


def test_a_set_shows_each_phase_only_to_the_checkers_that_judge_it():
    from conformance.harness.checker import BaseChecker, CheckerSet
    from conformance.harness.disagg.checker import DisaggChecker

    class Inherits(CountsSubmissions):  # judges what its parent judges
        name = "inherits"

    assert CountsSubmissions.judges("submitted") and Inherits.judges("submitted")
    assert not CountsSubmissions.judges("scheduled") and not Checker.judges("submitted")
    assert not DisaggChecker.judges("transfer") and not BaseChecker.judges("attached")
    shown: list[str] = []

    class Records(Checker):
        name = "records"

        def settled(self, obs, ev):
            shown.append("settled")

    checkers = CheckerSet([CountsSubmissions()])
    checkers.attach(obs=None)
    checkers.notify(Settled(view=None, idle=True))  # routes "settled": to no checker
    checkers.add(Records())  # added after the set routed the phase: routed again
    checkers.notify(Settled(view=None, idle=True))
    assert shown == ["settled"]
