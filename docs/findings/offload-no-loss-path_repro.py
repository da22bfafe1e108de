"""vLLM's OffloadingConnector has no path for a transfer job that fails: a failed
load (or store) stops the worker with an AssertionError instead of the request
being recomputed.  Standalone: imports only vllm and torch.

vLLM's real ``Scheduler`` and ``OffloadingConnector`` (scheduler and worker
roles) over vLLM's real ``CPUOffloadingManager``, a hybrid configuration (one
full-attention group, one Mamba group in align mode, prefix caching on); only the
``OffloadingWorker`` is this script's (the stock one needs CUDA streams), and it
completes each job with the outcome asked for.  Request A's prompt is stored in
the CPU tier, the device cache is reset, request B asks for the same prompt and
its load job completes with ``--outcome``:

    python offload-no-loss-path_repro.py --outcome ok     # control: PASS, B runs on its 8-token hit
    python offload-no-loss-path_repro.py --outcome fail   # FAIL: AssertionError in get_finished

A short or corrupted copy reports success (nothing in the connector or the
manager checks the bytes: a worker reports only job ids, TransferResult has no
checksum), so there the request computes on whatever landed; that half is a
design statement (read from the code), not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

B = 4
NUM_BLOCKS = 64
OUTCOME = {"ok": True}


class ScriptWorker(OffloadingWorker):
    """Completes every job at the next get_finished(), loads with OUTCOME["ok"]."""

    def __init__(self):
        self.done: list[TransferResult] = []
        self.loads = 0

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False) -> bool:
        self.loads += 1
        self.done.append(TransferResult(job_id, OUTCOME["ok"]))
        return True

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def wait(self, job_ids) -> None:
        pass


class ScriptSpec(CPUOffloadingSpec):
    """vLLM's CPU spec (its manager, policy and capacity); only the worker is the script's."""

    def get_worker(self, kv_caches):
        return ScriptWorker()


def configs():
    import json
    import tempfile

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512}, f)
    model = ModelConfig(model=folder, tokenizer=None, skip_tokenizer_init=True, max_model_len=256, dtype="float32")
    attn = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=16, dtype=torch.float32)
    page = attn.page_size_bytes
    mamba = MambaSpec(block_size=B, shapes=((3, 32), (2, 8, 8)), dtypes=(torch.float32, torch.float32),
                      page_size_padded=page, mamba_cache_mode="align")
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn.0"], attn), KVCacheGroupSpec(["mamba.0"], mamba)])
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
        "spec_name": "ScriptSpec", "spec_module_path": "__main__", "cpu_bytes_to_use": 256 * 2 * page * 2,
        "blocks_per_chunk": 1})
    cache = CacheConfig(block_size=B, enable_prefix_caching=True, mamba_cache_mode="align", mamba_block_size=B)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                             kv_transfer_config=transfer)
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vllm_config, kv_cache_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outcome", choices=("ok", "fail"), default="fail")
    args = ap.parse_args()
    OUTCOME["ok"] = args.outcome == "ok"
    init_none_hash(sha256)
    vllm_config, kv_cache_config = configs()
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=B,
                          log_stats=True)
    worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    worker.connector_worker.worker = ScriptWorker()  # register_kv_caches would build it from device tensors
    hasher = get_request_block_hasher(B, sha256)

    def request(rid, tokens):
        sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=2)
        return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                       block_hasher=hasher)

    def step():
        so = scheduler.schedule()
        meta = so.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        _, recving = worker.get_finished(so.finished_req_ids)  # vLLM's worker: the assertion is here
        out = KVConnectorOutput(finished_recving=recving or None,
                                kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=out))
        return so

    prompt = list(range(10, 22))  # 12 tokens: the state at 8 (the prompt's tail under interval 0) and KV [0, 8)
    scheduler.add_request(request("A", prompt))
    for _ in range(6):
        step()
    print(f"A finished; CPU tier holds {len(scheduler.connector.connector_scheduler.manager._policy.chunks)} chunks")
    scheduler.reset_prefix_cache()
    scheduler.add_request(request("B", prompt + [40]))
    try:
        for i in range(6):
            so = step()
            for new in so.scheduled_new_reqs:
                print(f"step {i}: B scheduled with {new.num_computed_tokens} tokens reused")
    except AssertionError:
        frame = traceback.extract_tb(sys.exc_info()[2])[-1]
        print(f"FAIL: a load job completed with success=False stops the worker: AssertionError at "
              f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} `{frame.line}`")
        return 1
    print("PASS: B's load completed and B ran" if OUTCOME["ok"] else "PASS: the failed load was recovered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
