"""SglangOptions (parsed from ``ImplConfig.options``) and the construction of
SGLang 0.5.23's own pools and hybrid radix cache, configured as a Full + Mamba
model configures them (``HybridReqToTokenPool`` + ``HybridLinearKVPool`` +
``UnifiedRadixCache(tree_components=(FULL, MAMBA))``).

The pools' tensors are tiny and never read: the harness owns the real memory.
SGLang only ever sees indices (KV token slots, Mamba slots), which are the
harness's KV blocks and state slots one for one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from conformance.contract import ImplConfig

MODES = ("no_buffer", "extra_buffer")
TREE_CORES = ("python", "rust")


@dataclass(frozen=True)
class SglangOptions:
    mode: str = "no_buffer"  # SGLang's --mamba-radix-cache-strategy
    page_size: int = 1  # tree/allocator page: 1 in no_buffer (SGLang asserts it), >= 1 in extra_buffer
    track_interval: int | None = None  # --mamba-track-interval (extra_buffer decode checkpoints)
    chunk: int | None = None  # the mamba cache chunk (FLA chunk in a real model); default: the page
    tree_core: str = "python"  # SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
    max_running: int = 16  # req_to_token rows (--max-running-requests)
    max_context: int = 4096
    kv_tokens: int = 0  # KV token slots; 0: num_kv_blocks * block_size of the ImplConfig
    mamba_slots: int = 0  # Mamba slots; 0: num_state_slots of the ImplConfig

    @classmethod
    def from_config(cls, config: ImplConfig) -> SglangOptions:
        o = dict(config.options)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(o) - known)
        if unknown:
            raise ValueError(f"unknown sglang option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        mode = o.get("mode", "extra_buffer" if int(o.get("page_size", 1)) > 1 else "no_buffer")
        if mode not in MODES:
            raise ValueError(f"sglang option mode={mode!r}: expected one of {', '.join(MODES)}")
        page = int(o.get("page_size", 1 if mode == "no_buffer" else config.block_size))
        if mode == "no_buffer" and page != 1:
            raise ValueError("sglang no_buffer mode needs page_size=1 (MambaComponent asserts it)")
        chunk = int(o["chunk"]) if o.get("chunk") is not None else page
        interval = o.get("track_interval")
        if mode == "extra_buffer":
            interval = int(interval) if interval is not None else 2 * page
            if interval % page:
                raise ValueError(f"sglang track_interval={interval} must be a multiple of page_size={page}")
        elif interval is not None:
            raise ValueError("sglang track_interval applies to mode=extra_buffer only")
        core = str(o.get("tree_core", "python"))
        if core not in TREE_CORES:
            raise ValueError(f"sglang option tree_core={core!r}: expected one of {', '.join(TREE_CORES)}")
        kv_tokens = int(o.get("kv_tokens") or config.num_kv_blocks * config.block_size)
        kv_tokens = max(page, kv_tokens // page * page)
        return cls(mode=mode, page_size=page, track_interval=interval, chunk=chunk, tree_core=core,
                   max_running=int(o.get("max_running", 16)), max_context=int(o.get("max_context", 4096)),
                   kv_tokens=kv_tokens, mamba_slots=int(o.get("mamba_slots") or config.num_state_slots))

    @property
    def extra_buffer(self) -> bool:
        return self.mode == "extra_buffer"

    @property
    def num_pages(self) -> int:
        """Harness KV blocks: SGLang's pages plus page 0, the allocator's padding page."""
        return self.kv_tokens // self.page_size + 1


# A Full + Mamba hybrid of 4 layers, one attention layer: the shapes only size
# SGLang's placeholder tensors (the harness computes with its own model).
LAYERS, FULL_LAYERS = 4, (3,)


@dataclass
class Built:
    """SGLang's own objects (typed by SGLang, which ships no stubs)."""

    cache: Any  # MambaRadixCache
    req_pool: Any  # HybridReqToTokenPool
    allocator: Any  # the KV token allocator
    server_args: Any


def build(opts: SglangOptions) -> Built:
    # The tree core is picked when UnifiedRadixCache is built.
    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = opts.tree_core
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    kw = dict(model_path="dummy", page_size=opts.page_size, mamba_radix_cache_strategy=opts.mode,
              disable_overlap_schedule=True)  # the CPU path and no_buffer both require it
    if opts.extra_buffer:
        kw["mamba_track_interval"] = opts.track_interval
    sa = ServerArgs(**kw)
    # Pre-seed: otherwise MambaComponent loads the HF config of "dummy" (a 45 s offline timeout).
    sa._mamba_cache_chunk_size = opts.chunk
    set_global_server_args_for_scheduler(sa)

    mamba_layers = [i for i in range(LAYERS) if i not in FULL_LAYERS]
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=1,
                                        head_dim=8, state_size=2, conv_kernel=2)
        cparams = Mamba2CacheParams(shape=shape, layers=mamba_layers)
    req_pool = HybridReqToTokenPool(size=opts.max_running, mamba_size=opts.mamba_slots, mamba_spec_state_size=1,
                                    max_context_len=opts.max_context, device="cpu", enable_memory_saver=False,
                                    cache_params=cparams, mamba_layer_ids=mamba_layers,
                                    enable_mamba_extra_buffer=opts.extra_buffer, enable_overlap_schedule=False)
    kv_pool = HybridLinearKVPool(size=opts.kv_tokens, dtype=torch.float32, page_size=opts.page_size, head_num=1,
                                 head_dim=1, full_attention_layer_ids=list(FULL_LAYERS), device="cpu",
                                 mamba_pool=req_pool.mamba_pool)
    if opts.page_size == 1:
        alloc = TokenToKVPoolAllocator(size=opts.kv_tokens, dtype=torch.float32, device="cpu", kvcache=kv_pool,
                                       need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size=opts.kv_tokens, page_size=opts.page_size, dtype=torch.float32,
                                            device="cpu", kvcache=kv_pool, need_sort=False)
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=opts.page_size,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA), enable_mamba_extra_buffer=opts.extra_buffer))
    return Built(cache, req_pool, alloc, sa)
