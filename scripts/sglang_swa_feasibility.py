#!/usr/bin/env python
"""Feasibility (issue 35): SGLang 0.5.23's window radix cache -- UnifiedRadixCache with the FULL and SWA
components over an SWAKVPool and an SWATokenToKVPoolAllocator -- built on a CPU, five window layers and one
full layer (Gemma 3's shape), window 8, page 1.  Run from the repository root in the SGLang environment:

    PYTHONPATH=$PWD .venvs/sglang/bin/python scripts/sglang_swa_feasibility.py

Prints each piece it built, or the first error with its traceback (exit 1).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback


def main() -> int:
    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    importlib.import_module("conformance.adapters.sglang.cpu_shim")  # the torchvision stand-in, before sglang
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1, disable_overlap_schedule=True))
    try:
        kv = SWAKVPool(size=256, size_swa=128, page_size=1, dtype=torch.float32, head_num=1, head_dim=1,
                       swa_attention_layer_ids=[0, 1, 2, 3, 4], full_attention_layer_ids=[5], device="cpu")
        print("SWAKVPool built")
        req = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
        print("ReqToTokenPool built")
        alloc = SWATokenToKVPoolAllocator(size=256, size_swa=128, page_size=1, dtype=torch.float32, device="cpu",
                                          kvcache=kv, need_sort=False, req_to_token_pool=req)
        print("SWATokenToKVPoolAllocator built")
        UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=req, token_to_kv_pool_allocator=alloc,
                                          page_size=1, sliding_window_size=8,
                                          tree_components=(ComponentType.FULL, ComponentType.SWA)))
        print("UnifiedRadixCache(FULL, SWA) built")
    except Exception:  # noqa: BLE001 - the feasibility answer is the error itself
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
