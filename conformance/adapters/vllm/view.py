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

from conformance.adapters.vllm.config import ATTN_GROUP, MAMBA_GROUP
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


def build_view(pool, registry: HashRegistry, running: tuple[str, ...]) -> tuple[CacheView, int]:
    """(the view, number of cached entries whose prefix is unknown)."""
    # One pool serves both groups: block b's refcount is stated for KV block b
    # and for state slot b alike (the harness allocates both, see Layout).
    refs = {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null}
    kv, states, unknown = [], [], 0
    for key, value in pool.cached_block_hash_to_block._cache.items():
        prefix = registry.prefixes.get(get_block_hash(key))
        if prefix is None:
            unknown += 1
            continue
        group = get_group_id(key)
        for block in _blocks(value):
            if group == ATTN_GROUP:
                kv.append(CachedKV(block.block_id, prefix))
            elif group == MAMBA_GROUP:
                states.append(CachedState(block.block_id, prefix))
    view = CacheView(kv_refcounts=refs, state_refcounts=dict(refs), cached_kv=tuple(kv),
                     cached_states=tuple(states), running=running)
    return view, unknown
