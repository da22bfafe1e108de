"""Prefill/decode disaggregation: worker memories, both transports, the
reference disaggregated implementation, transfer faults and mutants.

The NIXL tests run real NIXL 1.5.1 (UCX, two processes on loopback); where
``nixl`` does not import they skip and say why (scripts/test.sh installs it;
with CI=true a failed install fails the run)."""

from __future__ import annotations

import os

import pytest
import torch
from drive import run_disagg

from conformance.adapters.reference.disagg import ReferenceDisagg
from conformance.contract import ImplConfig
from conformance.disagg.contract import DECODE, PREFILL, Descriptor, DisaggLayouts, DisaggTransfer, WorkerLayout
from conformance.disagg.geometry import PARTS, WorkerGeometry
from conformance.errors import ConformanceFailure
from conformance.harness.disagg import ops
from conformance.harness.disagg.faults import FAULT_KINDS, FaultSpec
from conformance.harness.disagg.nixl_transport import nixl_available
from conformance.harness.disagg.provenance import POISON, Labels
from conformance.harness.disagg.worker_memory import WorkerMemory
from conformance.harness.disagg.workers import build_workers, make_transport
from conformance.judge.disagg import judged_disagg_session

NO_NIXL = nixl_available()
if NO_NIXL and os.environ.get("CI") == "true":  # in CI a skipped NIXL test would hide a missing real part
    raise RuntimeError(f"CI=true but {NO_NIXL} (scripts/test.sh installs nixl==1.5.1)")
needs_nixl = pytest.mark.skipif(NO_NIXL is not None, reason=f"real NIXL unavailable: {NO_NIXL}")
LAYOUTS = DisaggLayouts(WorkerLayout(PREFILL, 16, 8, 2), WorkerLayout(DECODE, 32, 8, 1))


def _run(model, oracle, scenario, pairing="2to1", transport="inprocess", faults=(), factory=ReferenceDisagg):
    return run_disagg(factory, model, oracle, scenario, pairing, transport, faults)


# -- layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shards,dtype", [(1, "float64"), (2, "float64"), (2, "float32")])
def test_state_roundtrip_through_sharded_part_layout(model, shards, dtype):
    g = WorkerGeometry.of(WorkerLayout(DECODE, 16, 4, shards, dtype), model.config)
    mem = WorkerMemory(g, Labels())
    assert torch.isnan(mem.buf.view(torch.float64)).all()  # poison, never cleared by the harness
    states = [type(s)(conv=torch.randn_like(s.conv), ssm=torch.randn_like(s.ssm))
              for s in [model.zero_state()] * model.config.num_rec_layers]
    mem.write_state(2, states, (1, 2, 3), "r")
    back = mem.read_state(2)
    tol = 0 if dtype == "float64" else 1e-6
    for a, b in zip(states, back):
        assert torch.allclose(a.conv, b.conv, atol=tol) and torch.allclose(a.ssm, b.ssm, atol=tol)
    # the page's padding and every other page keep their poison
    assert (mem.prov[g.page_offset(2) + g.state_view_bytes: g.page_offset(3)] == POISON).all()
    assert (mem.prov[: g.page_offset(2)] == POISON).all()


def test_conv_parts_are_contiguous_per_shard_and_differ_in_place(model):
    """A flat slice of a 2-shard conv state is not the 1-shard layout: part q of shard 1
    lands in the middle of the 1-shard q part, not after shard 0's whole conv state."""
    one = WorkerGeometry.of(WorkerLayout(DECODE, 16, 2, 1), model.config)
    two = WorkerGeometry.of(WorkerLayout(PREFILL, 16, 2, 2), model.config)
    flat = two.conv_shard_bytes  # where a flat split would put shard 1
    right = one.conv_part_offset(0, 0, 0, "q", local_head=1)
    assert right != flat
    spans = sorted((two.conv_part_offset(0, s, 0, p), two.conv_part_bytes(p)) for s in range(2) for p in PARTS)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


# -- transports ---------------------------------------------------------------------------------
def _transfer_roundtrip(kind, model, op):
    tr, _ = make_transport(kind)
    w = build_workers(LAYOUTS, model.config, tr)
    try:
        w.prefill.buf[:8192] = torch.arange(8192, dtype=torch.int64).to(torch.uint8)
        t = DisaggTransfer(7, "r", ((Descriptor(0, 100, 4096),), (Descriptor(4096, 40000, 4096),)), op)
        tr.submit(t)
        assert tr.progress() == []  # chunk 0 posted: in flight
        (notice,) = tr.progress()
        assert notice.ok and notice.id == 7 and notice.transport == tr.name
        assert all(c.src_digest == c.dst_digest for c in notice.chunks)
        assert torch.equal(w.decode.buf[100:4196], w.prefill.buf[:4096])
        assert torch.equal(w.decode.buf[40000:44096], w.prefill.buf[4096:8192])
        # a range past the registration fails the handle; the transport stays usable
        tr.submit(DisaggTransfer(8, "r", ((Descriptor(0, w.decode.geometry.buffer_bytes - 8, 64),),), op))
        (bad,) = tr.progress()
        assert not bad.ok and "NotFound" in bad.error
        tr.submit(DisaggTransfer(9, "r", ((Descriptor(0, 0, 64),),), op))
        assert tr.progress()[0].ok
    finally:
        w.close()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_inprocess_transport_moves_bytes_per_chunk(model, op):
    _transfer_roundtrip("inprocess", model, op)


@needs_nixl
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_nixl_transport_two_processes(model, op):
    _transfer_roundtrip("nixl", model, op)


def test_auto_transport_says_which_ran():
    tr, why = make_transport("auto")
    assert tr.name.startswith("nixl") == (NO_NIXL is None) and why


# -- the reference disaggregated implementation ------------------------------------------------------
@pytest.mark.parametrize("pairing", sorted(ops.PAIRINGS))
def test_reference_passes_general_scenario(model, oracle, pairing):
    s = _run(model, oracle, ops.GENERAL, pairing)
    c = s.coverage
    assert c[f"pairing_{pairing}"] > 0 and c["state_shards_transferred"] > 0
    assert c["mid_block_prompt_ends"] > 0 and c["boundary_prompt_ends"] > 0
    assert c["prefill_hits"] > 0 and c["transfers_verified"] > 0 and c["recomputes"] > 0  # the killed peer
    assert [e.fault for e in s.events] == ["kill-peer"]


@pytest.mark.parametrize("pairing", sorted(ops.PAIRINGS))
@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_reference_survives_every_transfer_fault(model, oracle, fault, pairing):
    scenario = (ops.DisaggSubmit("a", 18), ops.DisaggSubmit("b", 33, shared=33), ops.DisaggDrain(),
                ops.DisaggSubmit("c", 40, shared=40), ops.DisaggDrain())
    s = _run(model, oracle, scenario, pairing, faults=(FaultSpec(fault, 0),))
    assert [e.fault for e in s.events] == [fault], s.events
    assert all(e.transport == "in-process copy" for e in s.events)
    # Under READ the decode side initiated and knows its own completion: a lost
    # notification only leaves the prefill side uninformed.
    read = ops.PAIRINGS[pairing]["op"] == "READ"
    harmless = fault == "reorder-completions" or (fault == "lose-notification" and read)
    assert (s.coverage["recomputes"] >= 1) != harmless  # a damaged transfer is never trusted


def test_abort_while_the_transfer_is_in_flight_frees_everything(model, oracle):
    """The aborted request's decode pages stay held until its transfer ended
    (bytes may still land), then return; a lost notification ends by deadline."""
    for fault in ((), (FaultSpec("lose-notification", 0),)):
        s = _run(model, oracle, (ops.DisaggSubmit("a", 40), ops.DisaggStep(2), ops.DisaggAbort("a"),
                                 ops.DisaggSubmit("b", 20), ops.DisaggDrain()), "1to2", faults=fault)
        assert s.coverage["decode_steps"] > 0


@needs_nixl
def test_every_fault_fires_under_nixl_and_the_reference_survives(model, oracle):
    """One NIXL session, one fault per transfer (the dtype mismatch needs its own handshake)."""
    kinds = [k for k in FAULT_KINDS if k != "dtype-mismatch"]
    scenario = tuple(ops.DisaggSubmit(f"r{i}", 17 + 5 * i) for i in range(len(kinds))) + (ops.DisaggDrain(),)
    s = _run(model, oracle, scenario, transport="nixl", faults=[FaultSpec(k, i) for i, k in enumerate(kinds)])
    assert sorted(e.fault for e in s.events) == sorted(kinds)
    assert all(e.transport.startswith("nixl") for e in s.events)
    kill = next(e for e in s.events if e.fault == "kill-peer")
    assert "SIGKILL" in kill.what
    s2 = _run(model, oracle, (ops.DisaggSubmit("d", 20), ops.DisaggDrain()), transport="nixl",
              faults=[FaultSpec("dtype-mismatch")])
    assert [e.fault for e in s2.events] == ["dtype-mismatch"] and s2.coverage["recomputes"] == 1


def test_killed_peer_reports_disconnect_and_next_transfer_works(model, oracle):
    s = _run(model, oracle, (ops.DisaggSubmit("a", 20), ops.DisaggArmFault("kill-peer"), ops.DisaggSubmit("b", 20),
                             ops.DisaggDrain(), ops.DisaggSubmit("c", 30), ops.DisaggDrain()))
    assert s.coverage["transfers_verified"] >= 1 and s.coverage["recomputes"] == 1


# -- mutants --------------------------------------------------------------------------------------
def _disagg_mutants():
    from fault_injection.catalog import all_mutants

    return sorted(n for n, m in all_mutants().items() if m.target == "reference-disagg")


@pytest.mark.parametrize("name", _disagg_mutants())
def test_general_scenario_catches_each_mutant_in_some_pairing(model, oracle, name):
    from fault_injection.catalog import get_mutant

    factory = get_mutant(name).wrap(ReferenceDisagg)
    caught = []
    for pairing in sorted(ops.PAIRINGS):
        with pytest.raises(ConformanceFailure) as err:
            _run(model, oracle, ops.GENERAL, pairing, factory=factory)
        caught.append(err.value.kind)
    assert set(caught) <= {"logits", "invariant", "contract"}, caught


def test_stale_tail_names_the_request_whose_bytes_leaked(model, oracle):
    """Once decode pages are reused, an unzeroed tail holds finite bytes of an
    earlier request: the logits survive (weight 0), the byte audit does not."""
    from fault_injection.catalog import get_mutant

    factory = get_mutant("tail-not-zeroed").wrap(ReferenceDisagg)
    s = judged_disagg_session(factory, ImplConfig(options=ops.PAIRINGS["2to1"]), model, oracle, "inprocess")
    try:
        from conformance.harness.disagg.provenance import Label

        # an earlier tenant left finite bytes everywhere on the decode side
        dec = s.workers.decode
        dec.buf.view(torch.float64).fill_(0.25)
        dec.prov[:] = dec.labels.id(Label("kv", "old-tenant", (9, 9, 9)))
        s.apply(ops.DisaggSubmit("victim", 18))
        with pytest.raises(ConformanceFailure) as err:
            s.apply(ops.DisaggDrain())
    finally:
        s.close()
    assert err.value.kind == "invariant" and "unzeroed tail" in str(err.value), err.value
    assert "of request old-tenant" in str(err.value)


# -- the state machine --------------------------------------------------------------------------------
_LAST: dict = {}  # the recorder of the last machine run (a failing run raises before returning it)


def _machine_run(model, oracle, pairing, examples, factory=ReferenceDisagg, pool=None, shrink=False, seed=0):
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import get_state_machine_test

    from conformance.generate.disagg_machine import DisaggMachine, recorder_for_disagg
    from conformance.generate.machine import hypothesis_settings, stable_draws

    rec = _LAST["recorder"] = recorder_for_disagg()
    test = get_state_machine_test(
        lambda: DisaggMachine(factory, model=model, oracle=oracle, pairing=pairing, transport="inprocess",
                              workers=pool, recorder=rec),
        settings=hypothesis_settings(examples, 12, shrink=shrink))
    with stable_draws():
        hypothesis_seed(seed)(test)()
    return rec


@pytest.mark.parametrize("pairing", sorted(ops.PAIRINGS))
def test_the_simplest_example_reaches_every_required_situation(model, oracle, pairing):
    """Hypothesis runs its simplest example first, whatever the seed: by the order of
    the rules and of their draws, it alone reaches every counter the check requires."""
    from conformance.suite.checks import get_check

    rec = _machine_run(model, oracle, pairing, examples=1)
    required = [c for c in get_check("disagg-transfer").required if not c.startswith("pairing_")]
    assert all(rec.coverage[c] > 0 for c in required + [f"pairing_{pairing}"]), rec.coverage
    assert rec.failure is None


def test_pooled_workers_are_built_once_and_reset_to_fresh_poison(model, oracle):
    from conformance.harness.disagg.provenance import POISON
    from conformance.harness.disagg.workers import WorkerPool

    pool = WorkerPool(model.config, "inprocess")
    try:
        rec = _machine_run(model, oracle, "2to1", examples=4, pool=pool)
        assert rec.examples >= 2 and pool.built == 1
        layouts = ReferenceDisagg(ImplConfig(options=ops.PAIRINGS["2to1"])).disagg_layouts()
        w, _ = pool.get(layouts)
        assert pool.built == 1
        for mem in (w.prefill, w.decode):
            assert (mem.prov == POISON).all() and torch.isnan(mem.buf.view(torch.float64)).all()
        assert not w.transport.in_flight() and not w.transport.faults
    finally:
        pool.close()


@pytest.mark.parametrize("mutant", ["tail-not-zeroed", "failed-receive-as-success"])
def test_a_failing_example_is_its_operations_and_replays_on_fresh_workers(model, oracle, mutant):
    """The machine finds the bug on pooled workers; its recorded operations fail the
    same way on fresh ones, and the minimizer shortens them (what a repro file holds)."""
    from conformance.harness.disagg.workers import WorkerPool
    from conformance.harness.ops import op_from_dict
    from conformance.suite.disagg import pairing_config, replay_fails
    from conformance.suite.minimize import minimize
    from fault_injection.catalog import get_mutant

    factory = get_mutant(mutant).wrap(ReferenceDisagg)
    pool = WorkerPool(model.config, "inprocess")
    try:
        with pytest.raises(ConformanceFailure) as err:
            _machine_run(model, oracle, "1to2", examples=20, factory=factory, pool=pool)
    finally:
        pool.close()
    assert err.value.kind == "logits"
    recorded = _LAST["recorder"].failure
    assert recorded is not None and recorded[0].kind == "logits"
    steps = [op_from_dict(d) for d in recorded[1]]
    config = pairing_config("1to2", {})

    def fails(candidate) -> bool:
        exc, _ = replay_fails(factory, config, model, oracle, candidate, "inprocess")  # fresh workers
        return exc is not None and exc.kind == "logits"

    assert fails(steps)
    short = minimize(steps, fails, budget_s=30)
    assert len(short) <= 8 and fails(short)
    assert not replay_fails(ReferenceDisagg, config, model, oracle, short, "inprocess")[0]  # the clean one passes


def test_machine_options_are_checked():
    from conformance.generate.disagg_machine import DisaggMachine

    with pytest.raises(ValueError, match="armed mid-run"):
        DisaggMachine(ReferenceDisagg, faults=("dtype-mismatch",))
    with pytest.raises(ValueError, match="pairing"):
        DisaggMachine(ReferenceDisagg, pairing="3to1")


# -- the suite: the disagg family, mutants, replay ---------------------------------------------------
def test_disagg_family_runs_in_the_quick_profile_and_says_which_transport(tmp_path):
    from conformance.suite.checks import PROFILES
    from conformance.suite.run import RunOptions, run

    assert "disagg-transfer" in [c.id for c in PROFILES["quick"].checks]
    result = run(RunOptions(checks=("disagg-transfer",), report_dir=tmp_path))
    (check,) = result.checks
    assert check.status == "passed", check.failure
    assert check.metrics["transport"].startswith("nixl" if NO_NIXL is None else "in-process")
    assert check.metrics["transport"] in check.description
    for counter in ("pairing_2to1", "pairing_1to2", "mid_block_prompt_ends", "state_shards_transferred"):
        assert check.coverage[counter] > 0
    # Hypothesis's examples share the workers: one pair (one NIXL peer process) per layout pairing
    assert check.metrics["workers_built"] == 2


def test_a_disagg_mutant_is_caught_with_a_short_repro_that_replay_reproduces(tmp_path):
    from conformance.cli.cmd_mutants import mutants_for, run_mutant
    from conformance.results.repro import load as load_repro
    from conformance.suite.replay import replay
    from conformance.suite.run import RunOptions
    from fault_injection.catalog import get_mutant

    assert set(_disagg_mutants()) <= {m.name for m in mutants_for("reference")}
    entry = run_mutant(get_mutant("failed-receive-as-success"), RunOptions(profile="quick"), tmp_path)
    assert entry["detected"] and entry["check"] == "disagg-transfer" and entry["checks_run"] == ["disagg-transfer"]
    assert entry["repro_steps"] <= 8
    outcome = replay(load_repro(entry["repro"]))
    assert outcome.reproduced and outcome.kind == entry["kind"]
    clean = replay(load_repro(entry["repro"]), cli_mutant="none")
    assert not clean.reproduced
