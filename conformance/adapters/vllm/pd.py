"""Two real vLLM 0.33.0 Schedulers driven through prefill/decode with the NixlConnector's
scheduler side (prototype for the scheduler-level P/D adapter of issue 13).

Everything that decides is vLLM's code: each ``Scheduler`` builds vLLM's own
``NixlConnector`` (role SCHEDULER: ``NixlPullConnectorScheduler``) from a
``KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer"|"kv_consumer",
kv_buffer_device="cpu", kv_load_failure_policy="recompute")``.  So the prompt truncation by
one token for Mamba (``_truncate_request_for_prefill``), the claim of remote tokens
(``get_num_new_matched_tokens``), the held blocks and the transfer parameters
(``request_finished``), the per-group block lists handed to the worker
(``NixlConnectorMetadata.reqs_to_recv`` / ``reqs_to_send``) and the recovery of a failed load
(``failed_recving`` under ``recompute``) are vLLM's.

What stands in for vLLM's *worker* here is this module's caller: it reports what the worker
would (``finished_recving``, ``failed_recving``, ``finished_sending``) through
``KVConnectorOutput``.  In the full adapter the harness executes the worker side on its
disaggregation transport (issue 12): it moves the blocks named by ``reqs_to_recv`` between
the two sides' memories (attention K/V of every named block, and the recurrent state of the
one Mamba slot ``remote_block_ids`` keeps), then reports the outcome here.  vLLM's worker
(``NixlPullConnectorWorker``) is not used: it needs a model runner's registered KV caches.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request as VRequest
from vllm.v1.structured_output import StructuredOutputManager

from conformance.adapters.vllm.config import VllmOptions
from conformance.adapters.vllm.startup import start

# What vLLM's toy proxy sends to the prefill instance.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_EOS = 2
_TOKEN = 7  # what the stand-in model samples (the harness samples real tokens in the adapter)


def nixl_transfer_config(role: Literal["kv_producer", "kv_consumer"], engine_id: str | None = None) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=engine_id or str(uuid.uuid4()),
                            kv_buffer_device="cpu", kv_load_failure_policy="recompute")


@dataclass
class Side:
    """One vLLM Scheduler with the NixlConnector's scheduler side."""

    role: str
    scheduler: Scheduler
    vllm_config: object
    pending_output: KVConnectorOutput | None = None
    outputs: dict = field(default_factory=dict)  # req_id -> kv_transfer_params of its finishing output
    finished: set = field(default_factory=set)

    @property
    def connector(self):
        return self.scheduler.connector

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool


class PdSchedulers:
    def __init__(self, block_size: int = 16, num_blocks: int = 64, prefix_match_unit: int | None = None):
        init_none_hash(sha256)
        self.opts = VllmOptions(block_size=block_size, num_blocks=num_blocks,
                                prefix_match_unit=prefix_match_unit or block_size)
        self.prefill = self._side("kv_producer")
        self.decode = self._side("kv_consumer")
        self._hasher = get_request_block_hasher(self.opts.prefix_match_unit, sha256)
        self.last_meta: Any = None

    def _side(self, role: Literal["kv_producer", "kv_consumer"]) -> Side:
        startup = start(self.opts, nixl_transfer_config(role))  # as the engine core starts it (.startup)
        vc, kvc = startup.vllm_config, startup.kv_cache_config
        s = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=self.opts.block_size, hash_block_size=self.opts.prefix_match_unit, log_stats=True)
        return Side(role, s, vc)

    def _request(self, rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> VRequest:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            extra_args=None if params is None else {"kv_transfer_params": dict(params)})
        sp.update_from_generation_config({}, eos_token_id=_EOS)
        return VRequest(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                        block_hasher=self._hasher)

    # -- one engine step: vLLM schedules, the stand-in worker runs it --------------------
    def step(self, side: Side) -> dict[str, tuple[int, int]]:
        """One schedule() + update_from_output(); returns {req_id: (start, num_scheduled)}."""
        so = side.scheduler.schedule()
        self.last_meta = so.kv_connector_metadata
        ids = list(so.num_scheduled_tokens)
        reqs = side.scheduler.requests
        plan = {r: (reqs[r].num_computed_tokens - so.num_scheduled_tokens[r], so.num_scheduled_tokens[r]) for r in ids}
        toks = [[_TOKEN] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        kvo, side.pending_output = side.pending_output, None
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=toks, kv_connector_output=kvo)
        for eco in side.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finished:
                    side.finished.add(o.request_id)
                    side.outputs[o.request_id] = o.kv_transfer_params
        return plan

    # -- prefill side ------------------------------------------------------------------------
    def prefill_request(self, rid: str, prompt: list[int], max_steps: int = 64) -> dict | None:
        """Runs one request on the prefill side to completion; its transfer parameters."""
        self.prefill.scheduler.add_request(self._request(rid, prompt, 1, PREFILL_PARAMS))
        for _ in range(max_steps):
            self.step(self.prefill)
            if rid in self.prefill.finished:
                return self.prefill.outputs.get(rid)
        raise RuntimeError(f"prefill of {rid} did not finish in {max_steps} steps")

    def held_blocks(self, side: Side) -> set[int]:
        return {b.block_id for b in side.pool.blocks if b.ref_cnt > 0 and not b.is_null}

    def finish_sending(self, rid: str) -> None:
        """The worker reports the decode side's READ notification: the held blocks go."""
        self.prefill.pending_output = KVConnectorOutput(finished_sending={rid})
        self.step(self.prefill)

    # -- decode side -------------------------------------------------------------------------
    def decode_add(self, rid: str, prompt: list[int], params: dict, max_tokens: int) -> dict:
        req = self._request(rid, prompt, max_tokens, {**params, "do_remote_prefill": True, "do_remote_decode": False})
        claims: list = []
        conn = self.decode.connector
        get = conn.get_num_new_matched_tokens

        def spy(request, num_computed):  # observe, do not change, vLLM's claim
            ans = get(request, num_computed)
            claims.append(ans)
            return ans

        conn.get_num_new_matched_tokens = spy
        try:
            self.decode.scheduler.add_request(req)
            self.step(self.decode)
        finally:
            conn.get_num_new_matched_tokens = get
        recv = getattr(self.last_meta, "reqs_to_recv", {}) or {}
        return {"status": req.status.name, "claimed": claims[0][0] if claims else None,
                "async": claims[0][1] if claims else None,
                "recv": {k: {"local_block_ids": getattr(m, "local_block_ids", None),
                             "remote_block_ids": getattr(getattr(m, "remote", None), "block_ids", None)}
                         for k, m in recv.items()}}

    def finish_transfer(self, rid: str, ok: bool = True) -> None:
        """The worker reports the READ's outcome (a failure also lands in finished_recving,
        as NixlConnectorWorker reports it: done, with failed_recving naming the request)."""
        self.decode.pending_output = KVConnectorOutput(finished_recving={rid},
                                                       failed_recving=set() if ok else {rid})
        self.step(self.decode)

    def run_decode(self, max_steps: int = 64) -> list[dict]:
        steps = []
        for _ in range(max_steps):
            if not self.decode.scheduler.has_unfinished_requests():
                break
            plan = self.step(self.decode)
            if plan:
                steps.append(plan)
        return steps

    def decode_finished(self, rid: str) -> bool:
        return rid in self.decode.finished
