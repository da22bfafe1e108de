"""LMCache 0.5.6's multi-process connector against vLLM 0.33.0 on a CPU (issue 36's spike).

Run in LMCache's own environment (it imports the harness only for vLLM's
configuration of the suite's tiny hybrid model: one attention group, one Mamba
group in align mode, blocks of 4, prefix caching on), with an LMCache MP server
already started in CPU mode on loopback:

    .venvs/lmcache/bin/python -m lmcache.v1.multiprocess.server \\
        --host 127.0.0.1 --port 5599 --chunk-size 16 --l1-size-gb 0.05 --eviction-policy LRU
    PYTHONPATH=$PWD .venvs/lmcache/bin/python docs/findings/lmcache-cpu_repro.py \\
        --port 5599 --mode lmcache_driven

Steps: both connector roles connect; the worker registers the KV caches (one
page per block backing both groups, as vLLM's model runner allocates it);
vLLM's real Scheduler prefills request A (33 tokens), the script writes a
recognisable value into each block A computes (standing where the model would)
and the connector stores them; the device prefix cache is reset; request B
asks for the same prompt, vLLM asks LMCache, loads, and the script compares
each loaded block with what A wrote: attention blocks and the Mamba group's
state block.  PASS: every block retrieved; FAIL: the step that failed.

``--mode auto`` (the CPU's default, engine-driven transfer) fails at
registration: "engine-driven transfer does not support multiple KV transfer
groups now" (lmcache/v1/multiprocess/transfer_context/worker_transfer.py:805).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from conformance.adapters.vllm.config import TINY, VllmOptions
from conformance.adapters.vllm.startup import start
from conformance.contract import ImplConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=5599)
    ap.add_argument("--mode", default="lmcache_driven", help="lmcache.mp.mp_transfer_mode: auto, lmcache_driven, "
                                                           "engine_driven")
    args = ap.parse_args()
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    opts = VllmOptions.from_config(ImplConfig(block_size=4, num_kv_blocks=64, num_state_slots=64, options={}))
    extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": args.port}
    if args.mode != "auto":
        extra["lmcache.mp.mp_transfer_mode"] = args.mode
    kvt = KVTransferConfig(kv_connector="LMCacheMPConnector",
                           kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
                           kv_role="kv_both", kv_connector_extra_config=extra)
    st = start(opts, kvt)
    vc, kc = st.vllm_config, st.kv_cache_config
    print("groups", [type(g.kv_cache_spec).__name__ for g in kc.kv_cache_groups], "mamba_cache_mode",
          vc.cache_config.mamba_cache_mode)
    worker = LMCacheMPConnector(vc, KVConnectorRole.WORKER, kc)
    nb = kc.num_blocks
    attn_spec, mamba_spec = (g.kv_cache_spec for g in kc.kv_cache_groups)
    page = attn_spec.page_size_bytes
    raw = torch.zeros(nb, page // 4)
    kv = raw.view(nb, 2, opts.block_size, TINY["attn_kv_heads"], TINY["head_dim"])
    mamba, off = [], 0
    for shape in mamba_spec.shapes:
        n = 1
        for d in shape:
            n *= d
        mamba.append(raw[:, off:off + n].unflatten(1, shape))
        off += n
    try:
        worker.register_kv_caches({"attn.0": kv, "mamba.0": mamba})
    except Exception:
        traceback.print_exc()
        print("FAIL: register_kv_caches")
        return 1
    # LMCache re-points the storage of the tensors it was handed at POSIX shared memory
    # (lmcache/v1/platform/devices/cpu/shm.py migrate_to_shm_and_wrap): pages are written and
    # read through those views from now on, as the model runner's own views would be.
    pages = kv.view(nb, -1)
    init_none_hash(sha256)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=opts.block_size, hash_block_size=opts.prefix_match_unit, log_stats=True)
    hasher = get_request_block_hasher(opts.prefix_match_unit, sha256)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    written: dict[tuple[int, int], torch.Tensor] = {}

    def request(rid, tokens):
        sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=2)
        return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                       block_hasher=hasher)

    def step(write=False):
        so = sched.schedule()
        worker.bind_connector_metadata(so.kv_connector_metadata)
        worker.start_load_kv(ctx)
        for new in so.scheduled_new_reqs if write else ():
            for g, ids in enumerate(new.block_ids):
                for i, b in enumerate(ids):
                    if b:
                        pages[b] = 1000 * (g + 1) + i + 1
                        written[(g, i)] = pages[b].clone()
        worker.wait_for_save()
        sending, recving = worker.get_finished(so.finished_req_ids)
        meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[5] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  kv_connector_worker_meta=meta)))
        return so

    def until_scheduled(write=False):
        for _ in range(40):
            so = step(write)
            if so.scheduled_new_reqs:
                return so.scheduled_new_reqs[0]
            time.sleep(0.2)  # the connector's lookup and load are asynchronous
        return None

    prompt = list(range(3, 36))
    sched.add_request(request("A", prompt))
    if until_scheduled(write=True) is None:
        print("FAIL: A never scheduled")
        return 1
    for _ in range(20):
        step()
        time.sleep(0.2)
        if not sched.requests and not sched.connector.has_pending_push_work():
            break
    sched.reset_prefix_cache()
    pages.zero_()
    sched.add_request(request("B", prompt + [40]))
    new = until_scheduled()
    if new is None:
        print("FAIL: B never scheduled")
        return 1
    hit = new.num_computed_tokens
    print(f"B reused {hit} tokens; blocks {new.block_ids}")
    checked = same = 0
    for g, ids in enumerate(new.block_ids):
        for i, b in enumerate(ids):
            if b and (g, i) in written and (i + 1) * opts.block_size <= hit:
                checked += 1
                ok = torch.equal(pages[b], written[(g, i)])
                same += ok
                print(f"  group {g} ({type(kc.kv_cache_groups[g].kv_cache_spec).__name__}) block {i} -> {b}: "
                      f"{'retrieved' if ok else 'DIFFERENT'}")
    if hit and checked and same == checked:
        print(f"PASS: {same} blocks stored by A and retrieved for B, the Mamba group's state among them")
        return 0
    print(f"FAIL: {same} of {checked} blocks retrieved (hit {hit})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
