"""Feasibility: two real vLLM 0.33.0 ``Scheduler``s with the NixlConnector's scheduler side, on a CPU.

What it proves (prints one ``OK`` line per point, exits 1 at the first that does not hold):

1. ``NixlConnector`` (vLLM 0.33.0, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``)
   is built by the real ``Scheduler`` (``KVConnectorRole.SCHEDULER``) for a hybrid
   ``KVCacheConfig`` (full attention + Mamba "align"), as ``kv_producer`` and ``kv_consumer``,
   with ``kv_buffer_device="cpu"``; the hybrid manager stays on (the connector is ``SupportsHMA``).
2. Prefill side: a request with ``do_remote_decode`` is truncated by one token
   (``NixlBaseConnectorScheduler._truncate_request_for_prefill``: Mamba backoff, the decoder
   derives h(N) itself) and capped at one token; when it finishes, ``request_finished``
   returns ``delay_free_blocks=True`` and the transfer parameters (``remote_block_ids`` per
   group, clipped to the state-bearing Mamba slot; ``remote_num_tokens`` = N-1); its blocks stay
   held (ref_cnt > 0) until the worker reports ``finished_sending``.
3. Decode side: the request with those parameters is claimed (``get_num_new_matched_tokens``
   returns (N-1, async)), waits in ``WAITING_FOR_REMOTE_KVS``; the ``NixlConnectorMetadata``
   built for the worker names local and remote block ids per group.  After the worker's
   ``finished_recving`` the request is scheduled from N-1 (it computes the last prompt token).
4. ``kv_load_failure_policy="recompute"``: a ``failed_recving`` report makes the scheduler
   recompute the request from its valid prefix (0 here) instead of failing it.

The worker side (NIXL agents, registration, READs) is not run here: the harness would
execute it (see docs/vllm-adapter.md, "Prefill/decode over NixlConnector").

Run: ``VLLM_TARGET_DEVICE=cpu .venvs/main/bin/python scripts/pd_feasibility/scheduler_pd.py``
(about 20 s, most of it importing vLLM).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def ok(cond: bool, what: str) -> None:
    print(("OK   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        raise SystemExit(1)


def main() -> int:
    from conformance.adapters.vllm.pd import PdSchedulers

    B = 16
    pd = PdSchedulers(block_size=B, num_blocks=64)
    ok(type(pd.prefill.connector).__name__ in ("NixlPullConnector", "NixlConnector"),
       f"prefill scheduler built {type(pd.prefill.connector).__name__} (kv_producer); "
       f"decode built {type(pd.decode.connector).__name__} (kv_consumer)")
    ok(not pd.prefill.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
       "hybrid KV cache manager stays on (SupportsHMA)")

    prompt = list(range(3, 3 + 2 * B + 5))  # 37 tokens: ends mid-block
    N = len(prompt)
    params = pd.prefill_request("r0", prompt)
    ok(params is not None and params.get("remote_num_tokens") == N - 1,
       f"prefill finished, request_finished -> remote_num_tokens={params and params.get('remote_num_tokens')} "
       f"(N-1={N - 1}), remote_block_ids={params and params.get('remote_block_ids')}")
    held = pd.held_blocks(pd.prefill)
    ok(len(held) > 0, f"prefill blocks held after the request finished (delay_free_blocks): {sorted(held)}")

    claim = pd.decode_add("r0", prompt, params, max_tokens=3)
    ok(claim["status"] == "WAITING_FOR_REMOTE_KVS" and claim["claimed"] == N - 1,
       f"decode claimed {claim['claimed']} remote tokens asynchronously, status {claim['status']}")
    ok(bool(claim["recv"]), f"decode connector metadata reqs_to_recv: {claim['recv']}")

    pd.finish_transfer("r0", ok=True)  # what the worker reports after its READs
    steps = pd.run_decode()
    first = steps[0]
    ok(first.get("r0", (None,))[0] == N - 1 and first["r0"][1] == 1,
       f"after finished_recving: scheduled from {first.get('r0')} (computes the last prompt token)")
    pd.finish_sending("r0")
    ok(not pd.held_blocks(pd.prefill), "prefill blocks freed after finished_sending")

    params = pd.prefill_request("r1", prompt[:-1] + [250])
    claim = pd.decode_add("r1", prompt[:-1] + [250], params, max_tokens=2)
    pd.finish_transfer("r1", ok=False)  # a failed READ
    steps = pd.run_decode()
    ok(steps[0].get("r1", (None,))[0] == 0 and pd.decode_finished("r1"),
       f"failed_recving under kv_load_failure_policy=recompute: recomputed from {steps[0].get('r1')}, finished")
    print("scheduler-level P/D: all points hold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
