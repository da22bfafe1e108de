"""The disaggregated family on the house's seams: every implementation call
guarded with the run's timeout (a hang is ``timeout``, a raise ``raised``,
as on one worker), one typed history, judgements made by composed checkers
that never write into the session, operations validated before any work, and
one drain limit for both families."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from drive import run_disagg

from conformance.adapters.reference.disagg import ReferenceDisagg
from conformance.cli.main import main as cli
from conformance.contract import ImplConfig
from conformance.disagg.contract import DisaggPlan
from conformance.errors import ConformanceFailure, HarnessError, ImplementationError, ReproFormatError
from conformance.harness import ops as single_ops
from conformance.harness.disagg import ops
from conformance.harness.disagg.checker import DisaggChecker
from conformance.harness.disagg.faults import FaultSpec
from conformance.harness.history import (
    DisaggPlanned,
    FaultFired,
    Finished,
    Judged,
    NoticeReceived,
    OpApplied,
    TransferSubmitted,
)
from conformance.judge.disagg import disagg_checkers, judged_disagg_session
from conformance.results.repro import parse
from conformance.suite.run import RunOptions, run

PAIRING = ImplConfig(options=ops.PAIRINGS["2to1"])


class Sleeping(ReferenceDisagg):
    def schedule(self, budget: int = 1 << 30) -> DisaggPlan:
        time.sleep(30)
        return super().schedule(budget)


class Raising(ReferenceDisagg):
    def schedule(self, budget: int = 1 << 30) -> DisaggPlan:
        raise RuntimeError("the disaggregated scheduler broke")


class Idle(ReferenceDisagg):
    def schedule(self, budget: int = 1 << 30) -> DisaggPlan:
        return DisaggPlan()


# -- guarded calls ------------------------------------------------------------------------------
@pytest.mark.parametrize("factory,kind", [(Sleeping, "timeout"), (Raising, "raised")])
def test_a_hanging_or_raising_call_is_a_finding_of_its_kind(model, oracle, factory, kind):
    s = judged_disagg_session(factory, PAIRING, model, oracle, "inprocess", timeout=1.0)
    try:
        s.apply(ops.DisaggSubmit("a", 18))
        started = time.monotonic()
        with pytest.raises(ImplementationError) as err:
            s.apply(ops.DisaggStep())
        took = time.monotonic() - started
    finally:
        s.close()
    assert err.value.kind == kind and f"{factory.__name__}.schedule()" in str(err.value)
    assert took < 10  # cut at the deadline, not after the 30 s sleep


MISBEHAVING = '''
import time

from conformance.adapters.reference import ReferenceCache
from conformance.adapters.reference.disagg import ReferenceDisagg


class Sleeping(ReferenceDisagg):
    def schedule(self, budget=1 << 30):
        time.sleep(5)
        return super().schedule(budget)


class Raising(ReferenceDisagg):
    def schedule(self, budget=1 << 30):
        raise RuntimeError("the disaggregated scheduler broke")


class SleepingCache(ReferenceCache):
    disagg_factory = Sleeping


class RaisingCache(ReferenceCache):
    disagg_factory = Raising
'''


@pytest.mark.parametrize("cls,kind", [("SleepingCache", "timeout"), ("RaisingCache", "raised")])
def test_the_disagg_check_reports_a_hang_and_a_raise_as_the_single_worker_checks_do(tmp_path, monkeypatch, cls,
                                                                                    kind):
    """Before: the sleeping one passed (5 s a step, 71 s in all) and the raising one was
    ``error/harness``.  Now each is an error of the implementation, of its kind."""
    (tmp_path / "misbehaving_disagg.py").write_text(MISBEHAVING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HCC_DISAGG_TRANSPORT", "inprocess")
    (check,) = run(RunOptions(impl=f"misbehaving_disagg:{cls}", checks=("disagg-transfer",), timeout=1.0,
                              report_dir=tmp_path / "r")).checks
    assert check.status == "error" and check.failure.kind == kind, check.failure
    assert "schedule()" in check.failure.message
    assert check.failure.operations and check.failure.events  # its operations, and its history's tail
    if kind == "timeout":
        assert "did not return within 1 s" in check.failure.message


# -- one history ----------------------------------------------------------------------------------
def test_the_session_records_one_typed_history(model, oracle):
    s = run_disagg(ReferenceDisagg, model, oracle, ops.GENERAL, "1to2")
    kinds = {type(ev) for ev in s.history.events}
    assert {OpApplied, DisaggPlanned, TransferSubmitted, Judged, NoticeReceived, FaultFired, Finished} <= kinds
    assert [ev.op for ev in s.history.events if isinstance(ev, OpApplied)] == list(ops.GENERAL)
    assert {ev.worker for ev in s.history.events if isinstance(ev, Judged)} == {"prefill", "decode"}
    (kill,) = s.events
    assert kill.fault == "kill-peer" and kill.transport == "in-process copy" and kill.transfer is not None
    data = s.history.as_data()
    json.dumps(data)  # the JSON form, as reports and repro files take it
    assert data[0] == {"event": "op", "index": 0, "op": "disagg-submit", "request_id": "r0", "prompt_len": 33,
                       "shared": 33, "max_new": 3}
    plan = next(d for d in data if d["event"] == "plan" and d["requests"])
    assert {"request_id", "worker", "start", "end", "block_table", "state_slot"} <= set(plan["requests"][0])


def test_a_failure_is_explained_by_the_history(model, oracle):
    from fault_injection.catalog import get_mutant

    factory = get_mutant("failed-receive-as-success").wrap(ReferenceDisagg)
    s = judged_disagg_session(factory, ImplConfig(options=ops.PAIRINGS["1to2"]), model, oracle, "inprocess",
                              faults=(FaultSpec("drop-descriptor"),))
    try:
        with pytest.raises(ConformanceFailure) as err:
            for op in (ops.DisaggSubmit("r2", 41, shared=41), ops.DisaggDrain()):
                s.apply(op)
    finally:
        s.close()
    assert err.value.kind == "logits" and str(err.value).startswith("[in-process copy] r2 on decode")
    tail = s.history.tail()
    assert tail[-1]["event"] == "verdict" and tail[-1]["ok"] is False and tail[-1]["worker"] == "decode"
    assert any(ev["event"] == "fault" and ev["fault"] == "drop-descriptor" for ev in s.history.as_data())


# -- the checkers ---------------------------------------------------------------------------------
def test_judgements_are_checkers_and_none_writes_into_the_session(model, oracle):
    names = [c.name for c in disagg_checkers()]
    assert names == ["disagg-logits", "disagg-reads", "disagg-coverage", "disagg-at-rest"]
    s = run_disagg(ReferenceDisagg, model, oracle, ops.GENERAL, "2to1")
    obs = s.observation
    with pytest.raises(TypeError):
        obs.tracks["x"] = obs.tracks["r0"]  # type: ignore[index]
    with pytest.raises(TypeError):
        obs.memories["decode"] = obs.memories["prefill"]  # type: ignore[index]
    assert s.coverage == s.checkers.coverage() and s.coverage["pairing_2to1"] > 0


def test_a_crashing_checker_is_a_harness_error_naming_it(model, oracle):
    class Broken(DisaggChecker):
        name = "broken"

        def computed(self, obs, ev):
            raise KeyError("oops")

    s = judged_disagg_session(ReferenceDisagg, PAIRING, model, oracle, "inprocess", extra=(Broken(),))
    try:
        s.apply(ops.DisaggSubmit("a", 18))
        with pytest.raises(HarnessError, match="checker 'broken' crashed in computed"):
            s.apply(ops.DisaggDrain())
    finally:
        s.close()


def test_one_drain_limit_for_both_families(model, oracle):
    with pytest.raises(ConformanceFailure) as err:
        run_disagg(Idle, model, oracle, (ops.DisaggSubmit("a", 18), ops.DisaggDrain()))
    assert err.value.kind == "stall"
    assert f"after {single_ops.MAX_DRAIN_STEPS} steps" in str(err.value)


# -- operations validated before any work -----------------------------------------------------------
def _disagg_doc() -> dict:
    doc = json.loads(Path("fixtures/scenarios/late-snapshot-published-too-late.json").read_text())
    doc.update(check="disagg-transfer", family="disagg", mutant=None, faults=[],
               impl_config={**doc["impl_config"], "options": ops.PAIRINGS["2to1"]},
               steps=[{"op": "disagg-submit", "request_id": "r0", "prompt_len": 18, "shared": 0, "max_new": 2},
                      {"op": "disagg-step", "count": 2}, {"op": "disagg-fault", "kind": "kill-peer"},
                      {"op": "disagg-drain"}])
    return doc


def test_disagg_repro_files_keep_loading_into_the_named_apart_operations():
    steps = parse(_disagg_doc()).operations
    assert steps == [ops.DisaggSubmit("r0", 18, 0, 2), ops.DisaggStep(2), ops.DisaggArmFault("kill-peer"),
                     ops.DisaggDrain()]
    assert {type(op).__name__ for op in steps}.isdisjoint({"Submit", "Step", "Drain", "Abort"})


@pytest.mark.parametrize("index,change,field", [
    (0, {"prompt_len": -5}, "steps[0].prompt_len: must be a positive integer"),
    (0, {"max_new": "x"}, "steps[0].max_new: must be a positive integer"),
    (0, {"shared": -1}, "steps[0].shared: must be an integer >= 0"),
    (0, {"prompt_len": True}, "steps[0].prompt_len: must be a positive integer"),
    (1, {"count": 0}, "steps[1].count: must be a positive integer"),
    (2, {"kind": "dtype-mismatch"}, "steps[2].kind: must be one of"),
    (2, {"kind": "meteor"}, "steps[2].kind: must be one of"),
    (1, {"op": "disagg-submit", "request_id": "r0", "prompt_len": 9}, "steps[1].request_id: 'r0' is submitted twice"),
    (1, {"op": "step", "budget": 4}, "steps[1].op: disaggregated operations (disagg-*) cannot mix"),
])
def test_bad_disagg_operations_exit_2_in_one_line_before_any_work(tmp_path, capsys, index, change, field):
    doc = _disagg_doc()
    step = doc["steps"][index]
    if "op" in change:
        step.clear()
    step.update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ReproFormatError) as refused:
        parse(json.loads(path.read_text()))
    assert field in str(refused.value)
    assert cli(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1, err
