"""Seeded bugs in the reference cache's sliding windows (issue 35), each from
a real upstream bug (``sliding-window-kda-offloading.md`` section 1) and each
a subclass overriding one decision of :class:`ReferenceCache`.  They change
nothing on a model without window layers, so only the window family meets
them; the general checkers must catch each (what a window layer reads, the
blocks a step uses held, the view against memory), never a check written for
one of them."""

from __future__ import annotations

from conformance.adapters.reference.block_pool import ROOT, chain
from conformance.adapters.reference.cache import Match, ReferenceCache
from conformance.contract import NULL_BLOCK
from fault_injection.registry import register, subclass_mutant


def _subclass(factory, name: str, **methods):
    return subclass_mutant(ReferenceCache, factory, name, **methods)


@register("window-free-in-flight", "RACE")
def window_free_in_flight(factory):
    """Window blocks are let go when a step is scheduled, on the count the
    request will have computed once the step ran (``end``), not on what it has
    computed: the step in flight still reads the blocks of its window's start
    (vllm#47728: ``remove_skipped_blocks`` on the optimistic
    ``num_computed_tokens`` under async scheduling; the fix frees on
    ``num_computed - num_in_flight``)."""

    def _plan_request(self, req, budget):
        step = ReferenceCache._plan_request(self, req, budget)
        if step is not None and self.windows:
            self._free_left_window(req, step.end + len(step.drafts))
        return step

    return _subclass(factory, "window-free-in-flight", _plan_request=_plan_request)


@register("window-hit-smallest-window", "WIN")
def window_hit_smallest_window(factory):
    """A prefix hit is matched on one window, the smallest, instead of every
    window: the groups with a wider window get the blocks that window spans
    and nothing before (TRT-LLM#10875: the prepopulated length set per window,
    Gemma 3's windows matching different lengths; the fix takes the minimum
    over windows, once)."""

    def _window_hit(self, prompt, p):
        B, n = self.B, -(-p // self.B)
        keys = self._chain_keys(prompt, n)
        first = max(0, p - min(self.windows) + 1) // B
        tables = []
        for g in range(len(self.windows)):
            table = [NULL_BLOCK] * first
            for i in range(first, n):
                block, common = self.kv.lookup(keys[i], tuple(prompt[i * B: (i + 1) * B]), g)
                if block is None or common < min(B, p - i * B):
                    return None
                table.append(block)
            tables.append(table)
        return tables

    return _subclass(factory, "window-hit-smallest-window", _window_hit=_window_hit)


@register("window-eagle-drop-after-finder", "WIN", target="reference-spec", options={"spec_drop_block": True})
def window_eagle_drop_after_finder(factory):
    """EAGLE's dropped block (a hit gives its last block back for the drafter
    to recompute) is taken off after the window finder matched the window at
    the undropped length: [NULL, NULL, A, B] becomes [NULL, NULL, A], a window
    one block short at the shorter hit (vllm#17398; the fix moved the drop into
    the per-manager finder, which then asks one contiguous block more)."""

    def _hit_kv_length(self, kv_len):
        return kv_len  # no drop before the finder ...

    def _reconcile(self, prompt, kv_len, blocks, keys):
        m = ReferenceCache._reconcile(self, prompt, kv_len, blocks, keys)
        if not (self.windows and self.spec.drop_block and m.length > self.B):
            return m
        p = m.length - self.B  # ... but after it, on what it found
        slot = self.states.lookup(tuple(prompt[:p]))
        if slot is None:
            return m
        n = -(-p // self.B)
        return Match(p, m.blocks[:n], slot, [t[:n] for t in m.windows])

    return _subclass(factory, "window-eagle-drop-after-finder", _hit_kv_length=_hit_kv_length,
                     _reconcile=_reconcile)


def _remembering(cache, req, computed):
    """Let go of the blocks that left the window, remembering which (request,
    group, block index, block) they were."""
    before = [list(t) for t in req.windows]
    ReferenceCache._free_left_window(cache, req, computed)
    freed = cache.__dict__.setdefault("_freed", {}).setdefault(req.request_id, [])
    for g, (old, new) in enumerate(zip(before, req.windows)):
        freed += [(g, i, a) for i, (a, b) in enumerate(zip(old, new)) if a != NULL_BLOCK and b == NULL_BLOCK]


def _insert_freed(cache, req) -> None:
    """Insert the request's whole range, the blocks it let go included, into
    the index as they were when it held them: whatever holds them now."""
    B, parent, keys = cache.B, ROOT, [ROOT]
    for i in range(req.computed // B):
        parent = chain(parent, tuple(req.tokens[i * B: (i + 1) * B]))
        keys.append(parent)
    for g, i, block in cache.__dict__.get("_freed", {}).get(req.request_id, []):
        if (i + 1) * B > req.computed:
            continue
        tokens = tuple(req.tokens[i * B: (i + 1) * B])
        cache.kv.unregister(block)  # the insert takes the slot over, as the radix tree's did
        cache.kv.register(keys[i], tokens, tuple(req.tokens[: (i + 1) * B]), block, g)


@register("window-finish-inserts-freed", "TIER")
def window_finish_inserts_freed(factory):
    """A finished request is inserted into the cache over its whole range,
    blocks that left the window and were let go included, though the pool has
    handed them to other requests since: they are matched as hits (and the
    radix tree frees them twice) (sglang#31486: ``cache_finished_req``
    inserted [0, keys_len) past ``swa_evicted_seqlen``)."""

    def _free_left_window(self, req, computed):
        _remembering(self, req, computed)

    def _finish(self, req):
        if self.windows:
            _insert_freed(self, req)
        ReferenceCache._finish(self, req)

    return _subclass(factory, "window-finish-inserts-freed", _free_left_window=_free_left_window,
                     _finish=_finish)


@register("window-unfinished-publishes-released", "SNAP")
def window_unfinished_publishes_released(factory):
    """An unfinished request publishes, after each of its steps, its range with
    the window blocks it let go in earlier steps as live entries, not as
    released (sglang#30845: ``cache_unfinished_req`` did not forward
    ``swa_evicted_seqlen`` to ``insert()``, so chunked prefill made evicted
    pages reusable KV)."""

    def _free_left_window(self, req, computed):
        _remembering(self, req, computed)

    def _slide_windows(self, req):
        self._register_window_blocks(req)
        _insert_freed(self, req)  # what it released in earlier steps is published too
        self._free_left_window(req, req.computed)

    return _subclass(factory, "window-unfinished-publishes-released", _free_left_window=_free_left_window,
                     _slide_windows=_slide_windows)
