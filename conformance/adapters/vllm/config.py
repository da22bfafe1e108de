"""Builds vLLM's configuration objects locally, without a hub or a GPU.

The scheduler takes its hybrid behaviour only from the ``KVCacheConfig`` (one
full-attention group, one Mamba group in "align" mode) and from
``CacheConfig``; the ``ModelConfig`` is required by ``VllmConfig`` but only its
``max_model_len`` matters, so it is built from a throw-away folder holding a
tiny ``config.json`` (no weights, no tokenizer).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass

from conformance.contract import ImplConfig

ADMISSIONS = ("second-hit", "always")


@dataclass(frozen=True)
class VllmOptions:
    """``ImplConfig.options`` understood by the vLLM adapter (unknown keys are an error).

    - ``prefix_match_unit``: vLLM's ``hash_block_size``; must divide the block size.
      Smaller than the block size turns on sub-block (partial) hits.
    - ``retention_interval``: ``CacheConfig.prefix_cache_retention_interval``:
      ``0`` (engine default: replay boundaries and junctions only), ``None``
      (dense: every block boundary), ``N`` (a multiple of the block size).
    - ``admission``: ``"second-hit"`` (vLLM's Marconi-style shared-prefix
      junctions, always on in 0.33) or ``"always"`` (accepted as an alias of
      vLLM's behaviour: vLLM has no switch to turn the junction logic off, so
      the adapter does not pretend to; see docs/vllm-adapter.md).
    - ``max_num_seqs``, ``max_model_len``: scheduler limits.
    - ``shared_prefix_checkpoint``: ``enable_mamba_shared_prefix_checkpoint``.
    - ``connector``: ``None``, ``true`` or ``{"divergent": bool, "async": bool}`` to plug in
      the store connector over the harness's host tier (see :mod:`.connector`).
    """

    block_size: int
    num_blocks: int
    prefix_match_unit: int
    retention_interval: int | None = 0
    admission: str = "second-hit"
    max_num_seqs: int = 16
    max_model_len: int = 4096
    shared_prefix_checkpoint: bool = False
    connector: dict | None = None

    @classmethod
    def from_config(cls, config: ImplConfig) -> VllmOptions:
        o = dict(config.options)
        known = {"prefix_match_unit", "retention_interval", "interval", "admission", "max_num_seqs",
                 "max_model_len", "shared_prefix_checkpoint", "connector"}
        unknown = set(o) - known
        if unknown:
            raise ValueError(f"unknown vLLM adapter options: {sorted(unknown)} (known: {sorted(known)})")
        bs = config.block_size
        pmu = o.get("prefix_match_unit") or bs
        if bs % pmu:
            raise ValueError(f"prefix_match_unit {pmu} must divide the block size {bs}")
        # "interval" is the reference adapter's name for the same knob.
        interval = o.get("retention_interval", o.get("interval", 0))
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
            raise ValueError(f"retention interval must be None or an integer >= 0, got {interval!r}")
        if interval is not None and interval % bs:
            raise ValueError(f"retention interval {interval} is not a multiple of the block size {bs}")
        admission = o.get("admission", "second-hit")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission policy {admission!r} (vLLM supports {ADMISSIONS})")
        # Block 0 is vLLM's null block; the pool needs at least one usable block.
        if config.num_kv_blocks < 2:
            raise ValueError("the vLLM block pool needs at least 2 blocks (block 0 is the null block)")
        return cls(block_size=bs, num_blocks=config.num_kv_blocks, prefix_match_unit=pmu,
                   retention_interval=interval, admission=admission,
                   max_num_seqs=int(o.get("max_num_seqs", 16)), max_model_len=int(o.get("max_model_len", 4096)),
                   shared_prefix_checkpoint=bool(o.get("shared_prefix_checkpoint", False)),
                   connector=o.get("connector"))


# A tiny decoder config: ModelConfig inspects the architecture in a subprocess
# (about 15 s), so the folder and the ModelConfig are built once per process.
_TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 65536,
                "torch_dtype": "float32", "rms_norm_eps": 1e-6}


@functools.lru_cache(maxsize=4)
def _model_config(max_model_len: int):
    from vllm.config import ModelConfig

    folder = tempfile.mkdtemp(prefix="hcc-vllm-model-")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(_TINY_CONFIG, fh)
    return ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)


def build_vllm_config(opts: VllmOptions, kv_transfer_config=None):
    """A VllmConfig with prefix caching on and Mamba "align" mode."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    # The budget is set per step by the adapter; this is only the ceiling.
    sched = SchedulerConfig(max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_model_len,
                            max_model_len=opts.max_model_len, enable_chunked_prefill=True,
                            is_encoder_decoder=False, watermark=0.0)
    cache = CacheConfig(block_size=opts.block_size, enable_prefix_caching=True, mamba_cache_mode="align",
                        prefix_match_unit=opts.prefix_match_unit,
                        prefix_cache_retention_interval=opts.retention_interval,
                        enable_mamba_shared_prefix_checkpoint=opts.shared_prefix_checkpoint)
    kw = {} if kv_transfer_config is None else {"kv_transfer_config": kv_transfer_config}
    vc = VllmConfig(model_config=_model_config(opts.max_model_len), scheduler_config=sched, cache_config=cache,
                    **kw)
    vc.cache_config.num_gpu_blocks = opts.num_blocks
    return vc


ATTN_GROUP, MAMBA_GROUP = 0, 1


def build_kv_cache_config(opts: VllmOptions):
    """One shared pool of ``num_blocks``; group 0 full attention, group 1 Mamba.

    Shapes are nominal: the scheduler never allocates tensors, and the harness
    owns the real memory (its own head sizes)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    bs = opts.block_size
    return KVCacheConfig(
        num_blocks=opts.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16,
                                                            dtype=torch.float32)),
            KVCacheGroupSpec(["mamba.0"], MambaSpec(block_size=bs, shapes=((3, 32), (2, 8, 8)),
                                                    dtypes=(torch.float32, torch.float32),
                                                    mamba_cache_mode="align")),
        ],
        prefix_cache_retention_interval=opts.retention_interval)
