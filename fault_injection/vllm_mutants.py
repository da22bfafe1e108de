"""Seeded bugs in the vLLM adapter's stack, applied at run time to one adapter
instance (no vLLM code is copied or edited: each mutant wraps one decision).

``VLLM_MUTANTS[name](adapter) -> adapter`` patches a built
:class:`conformance.adapters.vllm.VllmCache`; the same mutants are registered
in :mod:`fault_injection.registry` (target ``"vllm"``) as factory wrappers, so
``--impl vllm --mutant NAME`` works once the registry loads this module.  The
suite must catch each through its generic checks (logits against the no-cache
reference, invariants), never through a check written for one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fault_injection.registry import instance_mutant, register


def _check(adapter) -> None:
    if not hasattr(adapter, "scheduler") or not hasattr(adapter, "runner"):
        raise TypeError(f"vLLM mutants apply to VllmCache instances, not {type(adapter).__name__}")


def state_wrong_position(adapter):
    """SNAP: on a prefix hit the model runner takes the recurrent state from one
    block column too early (``(num_computed - 1) // B - 1``), as a worker whose
    Mamba hit index is off by one would: the request continues from the state
    of an earlier position, the never-written null block, or a fresh state."""
    _check(adapter)
    runner = adapter.runner
    original = type(runner).prev_state_idx

    def prev_state_idx(self, rid, num_computed):
        hit = rid not in self.mamba_state_idx and num_computed > 0  # a new request starting past 0
        prev = original(self, rid, num_computed)
        return prev - 1 if hit else prev

    runner.prev_state_idx = prev_state_idx.__get__(runner)
    return adapter


def groups_not_reconciled(adapter):
    """GROUPS: the hybrid coordinator stops reconciling the Mamba group with the
    attention group: the Mamba finder's (shorter) hit no longer shortens the
    common hit, so ``num_computed_tokens`` advances to the attention hit while
    no recurrent state exists there (the LMCache#2845 class: attention restored,
    recurrent state not)."""
    _check(adapter)
    from vllm.v1.kv_cache_interface import MambaSpec

    coord = adapter.scheduler.kv_cache_manager.coordinator
    for idx, group in enumerate(coord.attention_groups):
        if not isinstance(group.spec, MambaSpec):
            continue
        base: Any = group.manager_cls  # a class known at run time only

        class Unreconciled(base):  # a subclass per adapter: vLLM's class itself is not touched
            @classmethod
            def find_longest_cache_hit(cls, *args, max_length, **kw):
                blocks, _ = super().find_longest_cache_hit(*args, max_length=max_length, **kw)
                return blocks, max_length

        coord.attention_groups[idx] = group._replace(manager_cls=Unreconciled)
    return adapter


def local_tail_kept(adapter):
    """TIER: when an external hit is longer than a local hit that ends inside a
    block, the scheduler compares the tiers on the block-rounded local hit and
    lets the external one win, but keeps the local blocks it rounded away (the
    sub-block tail is never released): the request adopts the *cached* partial
    blocks, and the external load then writes the later KV and recurrent state
    into blocks the prefix cache still registers for the shorter prefix.
    Needs the store connector and sub-block matching: runs of this mutant
    turn both on."""
    _check(adapter)
    manager = adapter.scheduler.kv_cache_manager
    manager.truncate_computed_blocks = lambda blocks, num_computed_tokens: blocks  # instance attribute only
    return adapter


def sub_block_copy_dropped(adapter):
    """COW: the worker skips the step's copy-on-write block copies
    (``SchedulerOutput.kv_cache_block_copies``), as a model runner that drops
    the copy list would: a hit that ends inside a block computes on in a new
    block that never received the cached partial block's KV or its state.
    Copies exist only for sub-block hits, so this lives exactly where the
    known sub-block defects of vLLM 0.33 also fire (MambaMixer2's spec, match
    unit 1): the suite must name it NEW beside them."""
    _check(adapter)
    from dataclasses import replace

    runner = adapter.runner
    original = runner.to_plan

    def to_plan(so):
        return replace(original(so), kv_copies=(), state_copies=())

    runner.to_plan = to_plan
    return adapter


def sub_block_hit_one_token_long(adapter):
    """HIT: the coordinator reports a hit that ends inside a block one token
    longer than what is cached (an off-by-one in the fine-grained lookup), so
    the request skips computing a token whose KV and state nobody wrote.  Only
    sub-block hits end inside a block: the mutant lives where the known
    sub-block defects also fire, and must be named NEW beside them."""
    _check(adapter)
    km = adapter.scheduler.kv_cache_manager
    coord = km.coordinator
    original = coord.find_longest_cache_hit
    B = adapter.opts.block_size

    def find_longest_cache_hit(block_hashes, max_cache_hit_length, *args, **kw):
        out = original(block_hashes, max_cache_hit_length, *args, **kw)
        blocks, n, rest = out[0], out[1], out[2:]
        if n % B and n + 1 <= max_cache_hit_length:
            n += 1
        return (blocks, n, *rest)

    coord.find_longest_cache_hit = find_longest_cache_hit  # instance attribute only
    return adapter


def fix_sub_block_boundary_stop(adapter):
    """FIX: a patch, not a bug.  A prefill chunk that starts inside a block
    stops at the next block boundary also when the prompt's checkpoint is
    exported from inside the step (vLLM 0.33's _mamba_block_aligned_split
    exempts that case), so the column vLLM registers at that boundary holds
    the state there.  Removes the cause of the known defect
    subblock-registration: a run with it must say FIXED for that defect."""
    _check(adapter)
    sched = adapter.scheduler
    original = sched._mamba_block_aligned_split
    B = sched.cache_config.block_size

    def split(request, num_new_tokens, num_new_local_computed_tokens=0, num_external_computed_tokens=0):
        n = original(request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        boundary = (start // B + 1) * B
        if start % B and start + n > boundary:
            return boundary - start
        return n

    sched._mamba_block_aligned_split = split
    return adapter


def kda_checkpoint_unaligned(adapter):
    """SNAP: vllm#53212 reverted.  The Mamba manager of the group the harness's recurrent layers live
    in (KDA's, FlashKDA alignment 16) decides to allocate an internal prefill checkpoint block without
    the chunk's start: ``_needs_internal_checkpoint`` no longer enforces the start-alignment invariant
    (``is_mamba_prefill_checkpoint_valid`` on the query start, v1/core/single_type_kv_cache_manager.py:
    1659-1690), so a checkpoint whose offset into the chunk FlashKDA cannot export (not a multiple of
    16) gets a block and a prefix-cache hash although the worker never writes it
    (``compute_mamba_prefill_checkpoints`` declines it, layers/mamba/checkpoint.py:21-63).  In 0.33 a
    scheduler that uses KDA's own alignment stops such a chunk at the block boundary first, so the
    path is reached where the scheduler's alignment is another Mamba group's (the first one's,
    scheduler.py:435-443): the run sets ``layer=mamba2+kda``."""
    _check(adapter)
    from vllm.utils.math_utils import cdiv

    manager = adapter.scheduler.kv_cache_manager.coordinator.single_type_managers[adapter.runner.groups.mamba]

    def needs_internal_checkpoint(request_id, query_start, query_end, checkpoint_position, prefill_end):
        # Before the fix the manager had no query start (#53212: "Pass total_computed_tokens through
        # KV-cache allocation so _needs_internal_checkpoint can enforce the same start-alignment
        # invariant as scheduling"): it checked the checkpoint against the chunk's end alone.
        idx = cdiv(query_end, manager.block_size) - 2
        blocks = manager.req_to_blocks[request_id]
        return (manager.has_prefill_checkpoint_blocks and query_end >= prefill_end
                and 0 < checkpoint_position < query_end and idx >= 0
                and (idx >= len(blocks) or blocks[idx].is_null
                     or (request_id in manager._allocated_block_reqs
                         and idx >= len(blocks) - manager.num_speculative_blocks)))

    manager._needs_internal_checkpoint = needs_internal_checkpoint  # instance attribute only
    return adapter


def window_freed_in_flight(adapter):
    """RACE: vllm#47728 reverted, as a synchronous engine meets it.  ``remove_skipped_blocks`` frees a
    sliding-window group's blocks on the optimistic computed count: the step being scheduled is counted as
    computed, so the blocks its first tokens' windows still read are freed (and may be handed out again)
    before it runs.  vLLM 0.33 frees on the processed count, ``num_computed - num_in_flight``
    (kv_cache_manager.py:557-568); with async scheduling the optimistic count was the in-flight step's, here
    it is the step the scheduler is allocating.  Every window group's manager of one adapter instance."""
    _check(adapter)
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    km = adapter.scheduler.kv_cache_manager
    ahead: dict[str, int] = {}
    allocate = km.allocate_slots

    def allocate_slots(request, num_new_tokens, *args, **kw):
        ahead[request.request_id] = num_new_tokens
        try:
            return allocate(request, num_new_tokens, *args, **kw)
        finally:
            ahead.pop(request.request_id, None)

    km.allocate_slots = allocate_slots  # instance attribute only
    for manager in km.coordinator.single_type_managers:
        if isinstance(manager, SlidingWindowManager):
            remove = manager.remove_skipped_blocks

            def remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None, _remove=remove):
                return _remove(request_id, processed_computed_tokens + ahead.get(request_id, 0), num_prompt_tokens)

            manager.remove_skipped_blocks = remove_skipped_blocks  # type: ignore[method-assign]  # the instance only
    return adapter


def window_eagle_drop_after_finder(adapter):
    """HIT: vllm#17398 reverted.  EAGLE's "drop the last matched block" is applied after the sliding-window
    finder instead of inside it: the finder looks for the window's contiguous blocks without the extra one
    (``_contiguous_blocks_for_hit`` adds it with EAGLE, single_type_kv_cache_manager.py:956-967) and the last
    block is popped afterwards, so [NULL, NULL, A, B] becomes [NULL, NULL, A]: the hit's window is one
    block short.  Needs EAGLE's block-drop path (vLLM 0.33 without lookahead block hashes: the run sets
    ``spec_lookahead_hashes=false``); the speculative window check meets it."""
    _check(adapter)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    coord = adapter.scheduler.kv_cache_manager.coordinator
    for idx, group in enumerate(coord.attention_groups):
        if not isinstance(group.spec, SlidingWindowSpec):
            continue
        base: Any = group.manager_cls

        class DropAfterFinder(base):  # a subclass per adapter: vLLM's class itself is not touched
            @classmethod
            def find_longest_cache_hit(cls, *args, drop_eagle_block=False, **kw):
                blocks, hit = super().find_longest_cache_hit(*args, drop_eagle_block=False, **kw)
                if drop_eagle_block and blocks and blocks[0]:
                    for table in blocks:
                        table.pop()
                    hit -= kw["kv_cache_spec"].block_size
                return blocks, hit

        coord.attention_groups[idx] = group._replace(manager_cls=DropAfterFinder)
    return adapter


VLLM_MUTANTS: dict[str, Callable] = {
    "vllm-state-wrong-position": state_wrong_position,
    "vllm-groups-not-reconciled": groups_not_reconciled,
    "vllm-local-tail-kept": local_tail_kept,
    "vllm-sub-block-copy-dropped": sub_block_copy_dropped,
    "vllm-sub-block-hit-one-token-long": sub_block_hit_one_token_long,
    "vllm-fix-sub-block-boundary-stop": fix_sub_block_boundary_stop,
    "vllm-kda-checkpoint-unaligned": kda_checkpoint_unaligned,
    "vllm-window-freed-in-flight": window_freed_in_flight,
    "vllm-window-eagle-drop-after-finder": window_eagle_drop_after_finder,
}


# The configuration each buggy code path needs to run at all: the tail a
# longer external hit should release exists only with a tier and sub-block
# matching (vLLM's default matches whole blocks).
# GDN's spec (no prefill checkpoint block): under MambaMixer2's, unmutated vLLM
# already fails with sub-block matching (docs/vllm-adapter.md, "What it
# found"), and a mutant is measured only where the real code conforms.
# The sub-block mutants are the opposite case: planted where the known
# sub-block defects also fire (MambaMixer2's spec, match unit 1), so that the
# run must tell them apart (known defect vs NEW, docs/reports.md).
OPTIONS: dict[str, dict] = {"vllm-local-tail-kept": {"connector": True, "prefix_match_unit": 1, "layer": "gdn"},
           "vllm-sub-block-copy-dropped": {"prefix_match_unit": 1},
           "vllm-sub-block-hit-one-token-long": {"prefix_match_unit": 1},
           "vllm-fix-sub-block-boundary-stop": {"prefix_match_unit": 1},
           "vllm-kda-checkpoint-unaligned": {"layer": "mamba2+kda"},
           "vllm-window-eagle-drop-after-finder": {"spec_lookahead_hashes": False}}
FIXES = {"vllm-fix-sub-block-boundary-stop": "subblock-registration"}

for _name, _apply in VLLM_MUTANTS.items():
    register(_name, (_apply.__doc__ or "X:").split(":")[0].strip(), target="vllm",
             options=OPTIONS.get(_name), fixes=FIXES.get(_name))(instance_mutant(_name, _apply, "vllm"))
