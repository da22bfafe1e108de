"""Fix-reverted mutants of vLLM 0.33's offloading connector (``--option connector=offload-lru``).

Each mutant takes back one upstream fix that vLLM 0.33.0 ships in
``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``, on one
adapter instance (``VllmCache`` with vLLM's ``OffloadingConnector``, see
``conformance/adapters/vllm/offloading.py``), by patching the attribute or the
bound method of that instance's scheduler-side connector that holds the fix: no
vLLM code is copied, no vLLM class is modified.  The suite must catch each
through its general checks (logits against the no-cache reference, the
invariants, the expected-hit oracle), never by the mutant's own crash.

Registered with target ``"vllm"`` and the options its code path needs (the
offloading tier, and what else the fix is about).  The issue's other
candidates, and why they are not here (docs/vllm-adapter.md, "vLLM's own
offloading tier"):

- vllm#51100 (the chunk-boundary alignment of ``resolve_mamba_align_size`` for
  ``mamba_cache_mode="all"``): moot in 0.33.0, whose ``config/cache.py`` has
  ``MambaCacheMode = Literal["align", "none"]`` (line 176): no ``all`` mode
  to align, and ``none`` caches no prefix;
- vllm#42959, vllm#48911 and vllm#56709 (window groups: a stale block's
  zeroing, the final segment's reachable tail, the extra retained tokens):
  ``CANDIDATES`` below, with why the general suite does not catch them.
"""

from __future__ import annotations

from collections.abc import Callable

from fault_injection.registry import instance_mutant, register


def _connector_scheduler(adapter):
    tier = getattr(adapter, "connector", None)
    sched = getattr(getattr(tier, "scheduler_connector", None), "connector_scheduler", None)
    if sched is None:
        raise TypeError("the offloading mutants apply to a VllmCache with --option connector=offload-lru|offload-arc")
    return sched


def mamba_clamp_reverted(adapter):
    """TIER: vllm#44599 reverted.  The offloading scheduler no longer clamps the
    hit window to the Mamba block (``_lookup_complete_chunks``:
    ``round_down(max_hit_size_tokens, self._mamba_align_size)``, from
    ``resolve_mamba_align_size``): the Mamba group is looked up like a window
    of one chunk, so a prompt that ends exactly on a block boundary gets a hit
    of all its tokens but one, and the state loaded for it is the one stored at
    the boundary, which has already consumed the token the request computes
    next."""
    _connector_scheduler(adapter)._mamba_align_size = None
    return adapter


def eagle_pop_every_group(adapter):
    """HIT: the fix of vllm#52735 taken back.  With EAGLE's block drop on
    (``use_eagle_block_drop``, which MTP and EAGLE both use in 0.33) and no
    KV group annotated as the drafter's (the tiny model has no drafter layer),
    the offloading scheduler treats every group as a drafter group
    (``GroupOffloadConfig.is_eagle_group``), so the volatile-tail pop applies
    to the Mamba group too: a window of one chunk must then be found twice in
    a row, and the tier's hit for a request is zeroed wherever the tier holds
    the state at one boundary only."""
    sched = _connector_scheduler(adapter)
    spec = adapter.vllm_config.speculative_config
    if spec is None or not spec.use_eagle_block_drop():
        raise TypeError("vllm-offload-eagle-pop-every-group needs speculative decoding with EAGLE's block drop")
    config = sched.config
    sched.config = config._replace(kv_group_configs=tuple(g._replace(is_eagle_group=True)
                                                          for g in config.kv_group_configs))
    return adapter


def store_fence_dropped(adapter):
    """TIER: vllm#42959's fence taken back.  A store whose source block the
    scheduler may free before the store has read it (a window's block; here
    the Mamba group, a window of one chunk to this scheduler: the boundary
    states the core scheduler hands off, and a partial tail's copy-on-write
    source) is no longer registered in ``_block_id_to_pending_jobs`` when it
    is created (``fenced_block_ids``), so when the block is allocated again
    before the worker copied it, vLLM no longer waits for the store
    (``jobs_to_flush``): the asynchronous copy reads what the block's new
    owner wrote, and the CPU tier keeps it under the old prefix's key."""
    sched = _connector_scheduler(adapter)
    original = sched._build_connector_meta

    def build(scheduler_output):
        meta = original(scheduler_output)
        for job_id in meta.store_jobs:
            status = sched._jobs.get(job_id)
            if status is not None and status.fenced_block_ids:
                sched._remove_pending_job(job_id, status.fenced_block_ids)
                status.fenced_block_ids = None
        return meta

    sched._build_connector_meta = build  # instance attribute only
    return adapter


def finished_store_fence_dropped(adapter):
    """TIER: the flush of a finished request's pending stores taken back.  When
    a request finishes, vLLM frees its blocks at once and registers the blocks
    its pending store jobs still have to read (``deferred_fence_block_ids``,
    ``request_finished`` and ``_build_store_jobs``), so that a block allocated
    again before the worker copied it flushes the store first
    (``jobs_to_flush``, waited on by the worker before the step computes).
    Without it the deferred copy runs after the block's new owner wrote it,
    and the CPU tier keeps the new owner's KV under the finished request's
    key."""
    sched = _connector_scheduler(adapter)
    original = sched._build_connector_meta

    def build(scheduler_output):
        meta = original(scheduler_output)
        kept = set()
        for job_id in list(meta.jobs_to_flush or ()):
            status = sched._jobs.get(job_id)
            req = sched._req_status.get(status.req_id) if status is not None else None
            if status is not None and status.is_store and req is not None and req.req.is_finished():
                continue  # a finished request's store: not flushed
            kept.add(job_id)
        meta.jobs_to_flush = kept
        return meta

    sched._build_connector_meta = build
    return adapter


def window_stale_blocks_kept(adapter):
    """TIER: vllm#42959 reverted.  A window group's block that the core
    scheduler freed (``SlidingWindowManager.remove_skipped_blocks``: it left the
    window) while its chunk was not stored yet, and that a later step allocated
    again, is no longer zeroed in the request's pending-store positions
    (``_update_req_states``, offloading/scheduler.py:1533-1552: a block id of
    this step's allocations in ``[next_stored_chunk_idx, end)`` of a window
    group becomes 0, and ``_build_store_jobs`` skips 0, :1947-1948 and
    :2036-2037), so the deferred store reads the block's new owner's KV and the
    CPU tier keeps it under the old chunk's key."""
    sched = _connector_scheduler(adapter)
    original = sched._update_req_states

    def update(scheduler_output):
        resumed = set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        before = {rid: {g: list(rs.group_states[g].block_ids) for g in sched._sliding_window_groups}
                  for rid, rs in sched._req_status.items() if rid not in resumed}
        original(scheduler_output)
        for rid, groups in before.items():
            rs = sched._req_status.get(rid)
            if rs is None:
                continue
            for g, old in groups.items():
                ids = rs.group_states[g].block_ids
                for j, b in enumerate(old[: len(ids)]):
                    if ids[j] == 0 and b != 0:  # zeroed by the fix: the stale id back
                        ids[j] = b
                        stale[(rid, b)] = stale.get((rid, b), 0) + 1
                        adapter.stats["mutant_fired"] = adapter.stats.get("mutant_fired", 0) + 1

    stale: dict[tuple[str, int], int] = {}  # (request, block id) the fix would have zeroed, for the count below
    build_stores = sched._build_store_jobs

    def stores(scheduler_output):  # counts the store jobs that read such a block; changes nothing
        jobs = build_stores(scheduler_output)
        for job in jobs.values():
            if any((job.req_id, int(b)) in stale for b in job.src_spec.block_ids):
                adapter.stats["mutant_stale_stores"] = adapter.stats.get("mutant_stale_stores", 0) + 1
        return jobs

    sched._update_req_states = update
    sched._build_store_jobs = stores
    return adapter


def window_final_tail_dropped(adapter):
    """TIER: vllm#48911 reverted.  The store mask of a window group no longer
    keeps the reachable tail of a request's final, partial alignment segment:
    ``_build_store_jobs`` passes ``final_segment_end_chunk_idx`` (the stored
    horizon, offloading/scheduler.py:1926-1940) to ``_reachable_store_block_mask``
    (:1762-1796), and ``SlidingWindowManager.reachable_block_mask`` keeps the
    window's blocks before that end (v1/core/single_type_kv_cache_manager.py:
    1124-1133) besides the tail of every full segment; reverted, the mask sees
    full segments only, so a prompt ending inside a segment stores no window
    for its end and a later request gets no host hit there."""
    sched = _connector_scheduler(adapter)
    original = sched._reachable_store_block_mask

    def mask(group_config, start_chunk_idx, end_chunk_idx, final_segment_end_chunk_idx, reachable_boundaries):
        out = original(group_config=group_config, start_chunk_idx=start_chunk_idx, end_chunk_idx=end_chunk_idx,
                       final_segment_end_chunk_idx=None, reachable_boundaries=reachable_boundaries)
        fixed = original(group_config=group_config, start_chunk_idx=start_chunk_idx, end_chunk_idx=end_chunk_idx,
                         final_segment_end_chunk_idx=final_segment_end_chunk_idx,
                         reachable_boundaries=reachable_boundaries)
        if out != fixed:
            adapter.stats["mutant_fired"] = adapter.stats.get("mutant_fired", 0) + 1
        return out

    sched._reachable_store_block_mask = mask
    return adapter


def window_extra_retained_dropped(adapter):
    """TIER: vllm#56709 reverted.  A window group's offload coverage no longer
    includes the ``extra_retained_tokens`` that the block manager keeps below
    the window for multi-module MTP (``SlidingWindowSpec.extra_retained_tokens``,
    set by ``get_kv_cache_configs``, v1/core/kv_cache_planning.py:1634-1641):
    the lookup window is the bare window's chunks (``get_sliding_window_size_in_chunks``,
    offloading/config.py:61-73, and ``load_window_size_in_chunks``,
    offloading/scheduler.py:117-134) and the store mask is not widened (:1773-1784),
    so a hit is admitted whose retained history the lookup never checked and
    the producer may never have stored."""
    from dataclasses import replace

    sched = _connector_scheduler(adapter)
    config = sched.config
    groups = []
    for g in config.kv_group_configs:
        spec = g.kv_cache_spec
        if getattr(spec, "extra_retained_tokens", 0):
            spec = replace(spec, extra_retained_tokens=0)
            g = g._replace(kv_cache_spec=spec,
                           sliding_window_size_in_chunks=-(-spec.sliding_window // g.tokens_per_chunk))
        groups.append(g)
    if tuple(groups) == config.kv_group_configs:
        raise TypeError("vllm-offload-window-extra-retained-dropped needs a window group with extra retained tokens "
                        "(multi-module MTP)")
    sched.config = config._replace(kv_group_configs=tuple(groups))
    return adapter


VLLM_OFFLOAD_MUTANTS: dict[str, Callable] = {
    "vllm-offload-mamba-clamp-reverted": mamba_clamp_reverted,
    "vllm-offload-eagle-pop-every-group": eagle_pop_every_group,
    "vllm-offload-store-fence-dropped": store_fence_dropped,
    "vllm-offload-finished-store-fence-dropped": finished_store_fence_dropped,
}

# The two store fences (vllm#42959's family) are caught since the view lists the CPU tier's ready
# chunks and the invariants judge them against the store's provenance (judge/invariants.py
# check_host_view), and tier-races builds the history that turns a pool over in one step
# (generate/rules/turnover.py): before, the wrong bytes sat in the tier until a request happened
# to load that very chunk, which no seed did.
# Fixes taken back that the general suite does not catch yet, so not registered
# (``mutants --impl vllm`` would read them as blind spots, which they are).  The window fixes (measured
# 2026-12-04 on tier-reuse and tier-races over the window model, seed 0; docs/vllm-adapter.md):
# #42959's zeroing fires (2014 ids) but no store job read a zeroed id (0): a window chunk
# outlives its block unstored only where the CPU tier refuses the store, which neither the
# default tier nor offload_chunks=8 did; #48911's final-segment tail changed no mask (0 calls):
# with one block per chunk a dense segment is one block, every block reachable; #56709's
# extra retained tokens are 0 without multi-module MTP, which the adapter does not configure
# (the mutant refuses to apply).
CANDIDATES: dict[str, Callable] = {
    "vllm-offload-window-stale-blocks-kept": window_stale_blocks_kept,
    "vllm-offload-window-final-tail-dropped": window_final_tail_dropped,
    "vllm-offload-window-extra-retained-dropped": window_extra_retained_dropped,
}

# The offloading tier is the code path of every one of them, and the tier family's checks
# are the ones that move prefixes through it (the self-check runs those only).  The
# clamp matters where the tier holds the state at a prompt's last block boundary,
# which dense retention keeps wherever a step ends on one (interval 0 keeps only a
# prompt's tail, one block earlier).
OPTIONS: dict[str, dict] = {name: {"connector": "offload-lru"} for name in VLLM_OFFLOAD_MUTANTS}
OPTIONS["vllm-offload-mamba-clamp-reverted"]["retention_interval"] = None
# The drafter's block drop is the fallback's code path (as the matrix's drafter variant runs it).
OPTIONS["vllm-offload-eagle-pop-every-group"].update(spec_tokens=2, spec_lookahead_hashes=False,
                                                    retention_interval=None)

for _name, _apply in VLLM_OFFLOAD_MUTANTS.items():
    register(_name, (_apply.__doc__ or "X:").split(":")[0].strip(), target="vllm",
             options=OPTIONS[_name], family="tier")(instance_mutant(_name, _apply, "vllm"))
