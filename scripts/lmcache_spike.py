"""LMCache 0.5.6 MP connector against vLLM 0.33.0 on a CPU: import, connect to an
MP server started in CPU mode on loopback, register a hybrid model's KV caches
(one attention group, one Mamba group in align mode, as the suite's vLLM adapter
builds them), store one request's blocks and retrieve them for a second."""
import sys, traceback
import torch
from conformance.contract import ImplConfig
from conformance.adapters.vllm.config import VllmOptions, TINY
from conformance.adapters.vllm.startup import start
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 5599
step = lambda s: print(f"== {s}", flush=True)
step("import")
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
opts = VllmOptions.from_config(ImplConfig(block_size=4, num_kv_blocks=64, num_state_slots=64, options={}))
kvt = KVTransferConfig(kv_connector="LMCacheMPConnector",
                       kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
                       kv_role="kv_both",
                       kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": PORT, **({"lmcache.mp.mp_transfer_mode": sys.argv[2]} if len(sys.argv) > 2 else {})})
st = start(opts, kvt)
vc, kc = st.vllm_config, st.kv_cache_config
print("groups", [type(g.kv_cache_spec).__name__ for g in kc.kv_cache_groups], "block", opts.block_size,
      "mamba mode", vc.cache_config.mamba_cache_mode)
step("scheduler role (connects to the server)")
try:
    sched_conn = LMCacheMPConnector(vc, KVConnectorRole.SCHEDULER, kc)
    print("scheduler role ok")
except Exception:
    traceback.print_exc()
    sys.exit(1)
step("worker role")
try:
    worker = LMCacheMPConnector(vc, KVConnectorRole.WORKER, kc)
    print("worker role ok")
except Exception:
    traceback.print_exc()
    sys.exit(1)
step("register_kv_caches (CPU tensors)")
nb = kc.num_blocks
attn_spec = kc.kv_cache_groups[0].kv_cache_spec
mamba_spec = kc.kv_cache_groups[1].kv_cache_spec
# One page per block backs both groups, as vLLM's model runner allocates it
# (the Mamba page is padded to the attention page): conv and SSM are views
# into each block's page, the attention block is the whole page.
page = attn_spec.page_size_bytes
assert mamba_spec.page_size_bytes == page, (mamba_spec.page_size_bytes, page)
raw = torch.zeros(nb, page // 4)
kv = raw.view(nb, 2, opts.block_size, TINY["attn_kv_heads"], TINY["head_dim"])
mamba, off = [], 0
for shape in mamba_spec.shapes:
    n = 1
    for d in shape:
        n *= d
    mamba.append(raw[:, off:off + n].unflatten(1, shape))
    off += n
print("attn", tuple(kv.shape), "mamba", [tuple(t.shape) for t in mamba])
try:
    worker.register_kv_caches({"attn.0": kv, "mamba.0": mamba})
    print("registered")
except Exception:
    traceback.print_exc()
    sys.exit(1)

# LMCache re-points the storage of the tensors it was handed at a POSIX SHM segment
# (platform/devices/cpu/shm.py migrate_to_shm_and_wrap): pages are written and read
# through those views from now on, as the model runner's own views would be.
pages = kv.view(nb, -1)
print("kv storage re-pointed to shared memory:", kv.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr())
step("vLLM's Scheduler with the connector; request A prefills 32 tokens, its blocks are written and stored")
import time
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput, KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.forward_context import ForwardContext

init_none_hash(sha256)
sched = Scheduler(vllm_config=vc, kv_cache_config=kc, structured_output_manager=StructuredOutputManager(vc),
                  block_size=opts.block_size, hash_block_size=opts.prefix_match_unit, log_stats=True)
hasher = get_request_block_hasher(opts.prefix_match_unit, sha256)
ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})


def req(rid, toks, n=1):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    sp.update_from_generation_config({}, eos_token_id=2)
    return Request(request_id=rid, prompt_token_ids=list(toks), sampling_params=sp, pooling_params=None,
                   block_hasher=hasher)


def run_step(write=None):
    so = sched.schedule()
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(ctx)
    if write:
        write(so)
    worker.wait_for_save()
    sending, recving = worker.get_finished(so.finished_req_ids)
    meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[5] for _ in ids],
                            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                                  kv_connector_worker_meta=meta))
    sched.update_from_output(so, out)
    return so


PROMPT = list(range(3, 3 + 33))
A = req("A", PROMPT)
sched.add_request(A)
written = {}


def write_a(so):
    # as the model would: each block A computes gets a recognisable page
    for new in so.scheduled_new_reqs:
        for g, ids in enumerate(new.block_ids):
            for i, b in enumerate(ids):
                if b:
                    pages[b] = 1000 * (g + 1) + i + 1
                    written[(g, i)] = pages[b].clone()


for i in range(40):
    so = run_step(write_a)
    if so.scheduled_new_reqs:
        print("A scheduled at step", i, so.num_scheduled_tokens, "blocks",
              [len(x) for x in so.scheduled_new_reqs[0].block_ids])
        break
    time.sleep(0.2)
else:
    print("A never scheduled")
    sys.exit(2)
for _ in range(20):
    run_step()
    time.sleep(0.2)
    if not sched.requests and not sched.connector.has_pending_push_work():
        break
print("A finished; requests left", len(sched.requests))
step("evict the device cache, then request B with the same prompt: the connector's hit and load")
sched.reset_prefix_cache()
pages.zero_()
B = req("B", PROMPT + [40])
sched.add_request(B)
for i in range(40):
    so = run_step()
    if so.scheduled_new_reqs:
        nr = so.scheduled_new_reqs[0]
        print("B scheduled at step", i, "num_computed", nr.num_computed_tokens, "blocks", nr.block_ids)
        break
    time.sleep(0.2)
else:
    print("B never scheduled; waiting", [r.request_id for r in sched.waiting], "status", B.status)
    sys.exit(2)
hit = nr.num_computed_tokens
ok = 0
for g, ids in enumerate(nr.block_ids):
    for i, b in enumerate(ids):
        if b and (g, i) in written and (i + 1) * opts.block_size <= hit:
            same = torch.equal(pages[b], written[(g, i)])
            ok += same
            print(f"group {g} block {i} -> {b}: {'retrieved' if same else 'DIFFERENT'}")
print("retrieved blocks", ok)
