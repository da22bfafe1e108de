"""The SGLang adapter (``--impl sglang``): SGLang 0.5.23's own hybrid radix
cache (``UnifiedRadixCache`` with the FULL and MAMBA components, the Python or
the bundled Rust tree core), its ``HybridReqToTokenPool`` with the Mamba slot
allocator and its token/paged KV allocators, driven on a CPU, with the harness
standing where SGLang's scheduler loop and model runner stand.

SGLang decides; the adapter glues SGLang's own calls together as its scheduler
and result processor do.  Scheduler duties the adapter performs (and why):

1. **Match**: ``Req.init_next_round_input(cache)`` -> ``match_kv_cache`` ->
   ``match_prefix(cow_mamba=True)`` at admission, FCFS, one request at a time
   (the ``PrefillAdder`` order).  SGLang allocates the request's Mamba slot and
   names the copy-on-write source (``req.kv.mamba_cow_src_index``).
2. **Lock**: ``req.lock = cache.lock(req.last_node)`` on admission
   (``PrefillAdder._commit_prefill_admission``); a request that does not fit
   this step is unlocked and its copy-on-write slot freed again.
3. **Allocate**: SGLang's ``alloc_for_extend`` / ``alloc_for_decode`` (with
   ``ensure_mamba_capacity``), called with a one-request stand-in for the
   ``ScheduleBatch`` fields they read; they evict from the tree as needed.
4. **Copy-on-write of the Mamba slot** (the model runner's duty, deferred by
   SGLang to the batch): the first step's ``StateInit`` is
   ``copy_from(mamba_cow_src_index)``; a miss starts ``FRESH`` (SGLang's
   ``mamba_needs_clear``).
5. **Track rows (extra_buffer)**: ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``
   (SGLang's code, called unbound) picks the tracked position and ping-pong
   slot of a prefill chunk; a decode step whose new length is on
   ``mamba_track_grid`` tracks into ``mamba_next_track_idx`` (as
   ``prepare_for_decode``).  The forward's track write is the step's
   ``snapshots`` entry; after a decode step the adapter records
   ``mamba_last_track_idx/seqlen`` as the result processor does.
6. **Checkpoint**: after each prefill chunk that does not finish the request,
   ``checkpoint_kv_cache`` (SGLang's ``cache_unfinished_req`` successor).  In
   no_buffer mode that forks the running state into a new slot with
   ``mamba_pool.copy_from``: every pool copy SGLang asks for is recorded and
   becomes a plan-level ``state_copies`` entry, and the checkpoint itself runs
   at the start of the request's next step, because the contract has no copy
   after a step's computation (see docs/sglang-adapter.md).
7. **Release**: ``release_kv_cache(req, cache, checkpoint=True)`` for a
   finished request (``cache_finished_req``'s successor: the running or track
   slot is donated to the tree) and for an abort of a running request
   (``FINISH_ABORT``, as the scheduler's abort path).
8. **Evict**: never called directly: SGLang's allocation functions evict.

Importing this package installs the torchvision import stub (``cpu_shim``).
"""

from __future__ import annotations

from conformance.adapters.sglang import cpu_shim

cpu_shim.install()

try:
    import sglang  # noqa: F401
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the SGLang adapter needs sglang==0.5.23: bash scripts/install_sglang.sh .venvs/sglang; "
                      f"importing it failed with: {exc}") from exc

from conformance.adapters.sglang.adapter import SglangCache  # noqa: E402

__all__ = ["SglangCache"]
