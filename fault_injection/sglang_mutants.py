"""Seeded bugs in SGLang 0.5.23's hybrid cache stack, applied at run time to
one :class:`conformance.adapters.sglang.SglangCache` instance: each wraps one
SGLang object or function (no SGLang code is copied or edited).  Registered in
:mod:`fault_injection.registry` with target ``"sglang"``, with the options each
buggy code path needs.  The suite must catch each through its generic checks
(logits against the no-cache reference, invariants against memory), never a
check written for one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fault_injection.registry import instance_mutant, register


def _check(adapter) -> None:
    if not hasattr(adapter, "cache") or not hasattr(adapter, "req_pool"):
        raise TypeError(f"SGLang mutants apply to SglangCache instances, not {type(adapter).__name__}")


def stale_track_row(adapter):
    """SNAP: the clearing guard of the pool's ping-pong track rows never fires
    (sglang#34184): when ``HybridReqToTokenPool.alloc`` hands a request a row
    that an earlier request used, the row's device-side track table keeps the
    earlier request's slots.  The forward's track-save writes the new request's
    state into the old occupant's slot (by now cached in the tree or reused),
    and the new request's own track slot, never written, is donated to the tree."""
    _check(adapter)
    pool = adapter.req_pool
    table = pool.req_index_to_mamba_ping_pong_track_buffer_mapping
    original = pool.alloc
    seen: set[int] = set()

    def alloc(reqs):
        rows_before = {i: table[i].clone() for i in seen}
        rows = original(reqs)
        if rows is not None:
            for i in rows:
                if i in rows_before:
                    table[i] = rows_before[i]  # stale: the previous occupant's slots
                seen.add(int(i))
        return rows

    pool.alloc = alloc
    return adapter


def unwritten_track_committed(adapter):
    """SNAP: tracking is silently skipped but the ping-pong cursor still
    advances (sglang#32606 / #31474 class): a prefill chunk's track plan says
    "do not track" to the forward while ``mamba_last_track_seqlen`` and the
    cursor move on, so the next checkpoint donates a never-written track slot
    to the radix tree as the state at that length."""
    _check(adapter)
    original = adapter.prepare_track

    def prepare_track(batch, req):
        entry = original(batch, req)
        if dataclasses.is_dataclass(entry) and not isinstance(entry, type):
            return dataclasses.replace(entry, track_mask=False)
        return entry._replace(track_mask=False)

    adapter.prepare_track = prepare_track
    return adapter


def lock_over_release(adapter):
    """LOCK: a request that locks a node another request also holds releases
    the Full part of its lock once more right away (the copy-on-write lock
    over-release class, sglang#27038), and the lock keeps that shape when the
    checkpoints move it down the tree.  The request's prefix, and every page it
    publishes, stay unprotected while it runs: they are evictable, and
    eviction hands them to another request.  The receipt then says the Full
    part was never taken, so SGLang's own ``lock_ref > 0`` assertions stay
    silent and the suite must find the bug from what it observes."""
    _check(adapter)
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA
    cache, core = adapter.cache, adapter.cache.tree_core
    if not hasattr(core, "_node_arena"):
        raise TypeError("sglang-lock-over-release needs the Python tree core (tree_core=python)")
    original_lock, original_unlock = cache.lock, cache.unlock
    moved = {"from": None}  # the node of a Full-less lock just released (a checkpoint moves it)

    def skipping(receipt, component):
        return dataclasses.replace(receipt, skipped_lock_components=tuple(
            dict.fromkeys(tuple(receipt.skipped_lock_components) + (component,))))

    def below(node, ancestor) -> bool:
        while node is not None:
            if node is ancestor:
                return True
            node = node.parent
        return False

    def lock(node_id, skip_lock_components=()):
        source, moved["from"] = moved["from"], None
        node = core.node_by_id(node_id)
        if source is not None and below(node, source):
            skip_lock_components = tuple(skip_lock_components) + (FULL,)
        tl = original_lock(node_id, skip_lock_components)
        if tl is None or FULL in tl.receipt.skipped_lock_components or node is core.root_node:
            return tl
        if node.component_data[FULL].lock_ref >= 2:  # shared: the over-release
            cache.dec_lock_ref(node_id, skipping(tl.receipt, MAMBA))
            tl = dataclasses.replace(tl, receipt=skipping(tl.receipt, FULL))
        return tl

    def unlock(tl):
        moved["from"] = core.node_by_id(tl.node) if tl is not None and \
            FULL in tl.receipt.skipped_lock_components else None
        original_unlock(tl)

    cache.lock, cache.unlock = lock, unlock
    return adapter


SGLANG_MUTANTS: dict[str, Callable] = {
    "sglang-stale-track-row": stale_track_row,
    "sglang-unwritten-track-committed": unwritten_track_committed,
    "sglang-lock-over-release": lock_over_release,
}

# The configuration each buggy code path needs: track rows exist only in
# extra_buffer mode (page 4, tracked every 4 tokens); the lock walk needs the
# Python tree core (the Rust core's nodes are opaque handles).
OPTIONS: dict[str, dict] = {
    "sglang-stale-track-row": {"page_size": 4, "track_interval": 4},
    "sglang-unwritten-track-committed": {"page_size": 4, "track_interval": 4},
    "sglang-lock-over-release": {"tree_core": "python"},
}




for _name, _apply in SGLANG_MUTANTS.items():
    register(_name, (_apply.__doc__ or "X:").split(":")[0].strip(), target="sglang",
             options=OPTIONS.get(_name))(instance_mutant(_name, _apply, "sglang"))
