"""CacheView from vLLM's BlockPool.

vLLM keys cached blocks by a chained hash; the harness wants the token prefix
each cached block stands for, so the adapter remembers, for every request it
saw, which prefix each of its block hashes covers (``HashRegistry``).  A hash
the adapter never saw cannot be stated and is left out (counted in
``unknown``); that only happens for blocks an external store loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash, get_group_id

from conformance.adapters.vllm.config import Groups
from conformance.contract import CachedKV, CachedState, CacheView


@dataclass
class HashRegistry:
    hash_block_size: int
    prefixes: dict[bytes, tuple[int, ...]] = field(default_factory=dict)

    def record(self, request) -> None:
        """request.block_hashes[i] chains over the first (i+1)*hash_block_size tokens."""
        hashes = request.block_hashes
        if len(hashes) <= getattr(request, "_hcc_recorded", 0):
            return
        tokens = tuple(request.all_token_ids)
        for i in range(getattr(request, "_hcc_recorded", 0), len(hashes)):
            self.prefixes[hashes[i]] = tokens[: (i + 1) * self.hash_block_size]
        request._hcc_recorded = len(hashes)


def _blocks(value) -> list[KVCacheBlock]:
    return [value] if isinstance(value, KVCacheBlock) else list(value.values())


def owners(pool, managers) -> dict[int, set[int]]:
    """Block id -> the KV cache groups that own it now, read from vLLM's own
    structures: each group manager's ``req_to_blocks`` (the blocks its
    requests hold) and the group id of the block's hash (a cached entry of
    that group).  A free block that carries no hash is owned by none."""
    owned: dict[int, set[int]] = {}
    for manager in managers:
        for blocks in manager.req_to_blocks.values():
            for block in blocks:
                if not block.is_null:
                    owned.setdefault(block.block_id, set()).add(manager.kv_cache_group_id)
    for block in pool.blocks:
        if not block.is_null and block.block_hash is not None:
            owned.setdefault(block.block_id, set()).add(get_group_id(block.block_hash))
    return owned


def build_view(pool, registry: HashRegistry, running: tuple[str, ...], managers=(),
               groups: Groups | None = None) -> tuple[CacheView, int]:
    """(the view, number of cached entries whose prefix is unknown).

    One pool serves both groups, and a block id is a KV block while the
    attention group owns it, a state slot while the Mamba group owns it, and
    either while it is free (see :func:`owners`).  So ``kv_refcounts`` states
    the ``ref_cnt`` of every block the Mamba group does not own and
    ``state_refcounts`` that of every block the attention group does not own:
    a page holding cached KV is not a free state slot (a new snapshot would
    have to evict it), and the reverse.  A block held by something neither
    group lists (a connector's hand-off) is stated in both, so a leak at idle
    is still seen.  ``managers``: the coordinator's ``single_type_managers``
    (none: every block is stated in both maps).  A block a shadow Mamba group owns (``groups.shadow``:
    memory the harness does not model) is stated in both, like one held by something neither lists."""
    groups = groups or Groups()
    refs = {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null}
    owned = owners(pool, managers)
    kv_groups = {g for g in (groups.attn, *groups.windows) if g is not None}  # pages of KV, any attention group
    kv_refs = {b: n for b, n in refs.items() if owned.get(b, kv_groups) - {groups.mamba}}
    state_refs = {b: n for b, n in refs.items() if not (owned.get(b) and owned[b] <= kv_groups)}
    window_index = {g: i for i, g in enumerate(groups.windows)}
    kv, states, unknown = [], [], 0
    for key, value in pool.cached_block_hash_to_block._cache.items():
        prefix = registry.prefixes.get(get_block_hash(key))
        if prefix is None:
            unknown += 1
            continue
        group = get_group_id(key)
        for block in _blocks(value):
            if group == groups.attn:
                kv.append(CachedKV(block.block_id, prefix))
            elif group in window_index:
                kv.append(CachedKV(block.block_id, prefix, window_index[group]))
            elif group == groups.mamba:
                states.append(CachedState(block.block_id, prefix))
    view = CacheView(kv_refcounts=kv_refs, state_refcounts=state_refs, cached_kv=tuple(kv),
                     cached_states=tuple(states), running=running)
    return view, unknown
