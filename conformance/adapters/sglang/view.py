"""CacheView from SGLang's own structures: what the radix tree holds (walked
node by node on the Python tree core), who holds each KV page and Mamba slot
(tree locks, request rows, running and track slots), and what is free.

Refcounts state what protects a page or slot from eviction and reuse:
- a page or slot in the tree: the lock count of its node (FULL for KV, MAMBA
  for the state), so an unlocked cached entry is 0 (evictable) and a lock
  released too early shows as a page in use with refcount 0;
- a page in a live request's ``req_to_token`` row that the tree does not hold,
  the request's running slot and its ping-pong track slots: 1 per holder;
- anything neither free, in the tree nor held by a request: 1 (leaked).

The Rust tree core exposes no node walk in 0.5.23 (``node_by_id`` and
``root_node`` raise NotImplementedError), so with it the view states refcounts
from ``all_values_flatten`` / ``all_mamba_values_flatten`` and the rows, and no
cached entries (no keys to name them by).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from conformance.contract import CachedKV, CachedState, CacheView

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA


def _free_pages(allocator, P: int) -> set[int]:
    if hasattr(allocator, "get_all_free_pages"):
        pages = allocator.get_all_free_pages()
    else:
        pages = torch.cat((allocator.free_pages, allocator.release_pages))
    return {int(p) for p in pages.tolist()}


def walk_tree(cache):
    """(tokens, node) for every non-root node of the Python tree core, parents first."""
    root = cache.tree_core.root_node
    stack: list[tuple[Any, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            tokens = prefix + tuple(int(t) for t in child.key.token_ids)
            yield tokens, child
            stack.append((child, tokens))


def build_view(adapter, running: tuple[str, ...]) -> CacheView:
    cache, P = adapter.cache, adapter.P
    kv_ref: Counter = Counter()
    st_ref: Counter = Counter()
    tree_pages: set[int] = set()
    tree_slots: set[int] = set()
    cached_kv, cached_states = [], []
    walked = adapter.opts.tree_core == "python"
    if walked:
        for tokens, node in walk_tree(cache):
            full = node.component_data[FULL]
            start = len(tokens) - len(node.key.token_ids)
            if full.value is not None:
                last: dict[int, int] = {}
                for i, idx in enumerate(full.value.tolist()):
                    last[int(idx) // P] = start + i
                for page, pos in last.items():
                    tree_pages.add(page)
                    kv_ref[page] += full.lock_ref
                    cached_kv.append(CachedKV(page, tokens[: pos + 1]))
            mamba = node.component_data[MAMBA]
            if mamba.value is not None:
                slot = int(mamba.value.view(-1)[0])
                tree_slots.add(slot)
                st_ref[slot] += mamba.lock_ref
                cached_states.append(CachedState(slot, tokens))
    else:
        tree_pages = {int(i) // P for i in cache.all_values_flatten().tolist()}
        tree_slots = {int(s) for s in cache.all_mamba_values_flatten().view(-1).tolist()}
    for lv in adapter.live.values():
        req = lv.req
        if not lv.admitted or req.kv.req_pool_idx is None:
            continue
        row = adapter.req_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].tolist()
        for page in {int(i) // P for i in row}:
            if page not in tree_pages or not walked:  # Rust core: no lock counts to read, rows stand in
                kv_ref[page] += 1
        if req.kv.mamba_pool_idx is not None:
            st_ref[int(req.kv.mamba_pool_idx)] += 1
        buf = req.kv.mamba_ping_pong_track_buffer
        if buf is not None:
            for s in buf.tolist():
                if s >= 0:
                    st_ref[int(s)] += 1
    free_pages = _free_pages(adapter.allocator, P)
    for page in range(1, adapter.opts.num_pages):
        if page not in free_pages and page not in tree_pages and kv_ref[page] == 0:
            kv_ref[page] = 1  # allocated, yet nobody holds it: a leak
        kv_ref.setdefault(page, 0)
    free_slots = {int(s) for s in adapter.req_pool.mamba_allocator.free_slots.tolist()}
    for slot in range(1, adapter.opts.mamba_slots + 1):
        if slot not in free_slots and slot not in tree_slots and st_ref[slot] == 0:
            st_ref[slot] = 1
        st_ref.setdefault(slot, 0)
    return CacheView(kv_refcounts=dict(kv_ref), state_refcounts=dict(st_ref), cached_kv=tuple(cached_kv),
                     cached_states=tuple(cached_states), running=running)
