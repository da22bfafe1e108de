"""Seeded bugs in the reference cache, each a subclass overriding exactly the
one decision it breaks.  They reproduce the failure classes of the design
note and of ``upstream-bugs.md``; the suite must catch them through its
general checks, never through a check written for one of them."""

from __future__ import annotations

from dataclasses import replace

from conformance.adapters.reference.block_pool import ROOT, BlockPool, chain
from conformance.adapters.reference.cache import Match, ReferenceCache
from conformance.contract import RESUME, copy_from
from conformance.model import ModelConfig
from fault_injection.registry import register, subclass_mutant


def _subclass(factory, name: str, **methods):
    return subclass_mutant(ReferenceCache, factory, name, **methods)


@register("late-snapshot", "SNAP")
def late_snapshot(factory):
    """The snapshot is registered on the running slot, but the request keeps
    extending that same slot: the state is copied after the next tokens, so
    the snapshot holds a later position than the one it is registered under."""

    def _register_snapshot(self, req):
        self.states.register(tuple(req.tokens[: req.computed]), req.slot)

    return _subclass(factory, "late-snapshot", _register_snapshot=_register_snapshot)


@register("snapshot-without-conv", "SNAP")
def snapshot_without_conv(factory):
    """Copy-before-extend copies the matrix state but not the conv state: the
    new running slot keeps whatever conv bytes it held before."""

    def _admit(self, req, kv_copies):
        ok = ReferenceCache._admit(self, req, kv_copies)
        if ok and req.init.kind == "copy":
            req.init = copy_from(req.init.source, parts=("ssm",))
        return ok

    return _subclass(factory, "snapshot-without-conv", _admit=_admit)


@register("hit-off-by-one", "HIT")
def hit_off_by_one(factory):
    """A prefix hit is reported one token longer than what the snapshot covers."""

    def _reconcile(self, prompt, kv_len, blocks, keys):
        m = ReferenceCache._reconcile(self, prompt, kv_len, blocks, keys)
        p = m.length + 1
        if m.length and p < len(prompt) and -(-p // self.B) <= len(blocks):
            return Match(p, blocks[: -(-p // self.B)], m.slot)
        return m

    return _subclass(factory, "hit-off-by-one", _reconcile=_reconcile)


@register("free-while-referenced", "LIFETIME")
def free_while_referenced(factory):
    """A finishing request drops its blocks outright, even those another
    running request still shares: they go back to the free list in use."""

    def _release_blocks(self, blocks):
        for b in blocks:
            if self.kv.ref[b] == 0:
                continue  # the other sharer already dropped it: nothing is left to drop (no pool assertion)
            self.kv.ref[b] = 1
            self.kv.release(b)

    return _subclass(factory, "free-while-referenced", _release_blocks=_release_blocks)


@register("snapshot-wrong-boundary", "SNAP")
def snapshot_wrong_boundary(factory):
    """A snapshot is published under the start of the last block written
    instead of its end (``(computed - 1) // B * B``, an index-for-boundary
    slip as in vllm#54076): the slot holds the state after ``computed``
    tokens but is registered one block early (mid-block prompt ends round
    down to the block start)."""

    def _register_snapshot(self, req):
        boundary = (req.computed - 1) // self.B * self.B
        if boundary and self.states.register(tuple(req.tokens[:boundary]), req.slot):
            self.stats["snapshots"] += 1
            req.pins.append(("state", req.slot))
            req.init = copy_from(req.slot)
            req.slot = None

    return _subclass(factory, "snapshot-wrong-boundary", _register_snapshot=_register_snapshot)


@register("unreconciled-groups", "GROUPS")
def unreconciled_groups(factory):
    """The attention group's hit is taken as the common prefix length while the
    recurrent group's state comes from the (shorter) snapshot it found: the
    request skips computing tokens whose state it never had (LMCache#2845:
    attention restored, recurrent state not, computed tokens advanced for
    every group)."""

    def _reconcile(self, prompt, kv_len, blocks, keys):
        m = ReferenceCache._reconcile(self, prompt, kv_len, blocks, keys)
        length = min(kv_len, len(prompt) - 1)
        if m.slot is not None and length > m.length:
            return Match(length, blocks[: -(-length // self.B)], m.slot)
        return m

    return _subclass(factory, "unreconciled-groups", _reconcile=_reconcile)


@register("leak-on-free", "LIFETIME")
def leak_on_free(factory):
    """Freeing a request releases all its KV blocks but the last (a loop bound
    off by one): the block stays referenced with nobody holding it."""

    def _release_blocks(self, blocks):
        for b in blocks[:-1]:
            self.kv.release(b)

    return _subclass(factory, "leak-on-free", _release_blocks=_release_blocks)


class _PoolSetsRefOnHit(BlockPool):
    def acquire(self, block):
        self.ref[block] = 1  # the bug: "= 1" where "+= 1" was meant
        self.free.pop(block, None)


@register("evict-referenced", "LIFETIME")
def evict_referenced(factory):
    """A prefix hit sets the block's refcount to 1 instead of incrementing it,
    which is right only for a block revived from the free queue: a block that
    a running request shares is counted once, so when either holder lets go
    it is queued for eviction (and handed to the next allocation) while it is
    still in the other's block table."""

    def __init__(self, config=None):
        ReferenceCache.__init__(self, config)
        self.kv = _PoolSetsRefOnHit(self.config.num_kv_blocks)

    return _subclass(factory, "evict-referenced", __init__=__init__)


@register("hash-ignores-partial", "HASH")
def hash_ignores_partial(factory):
    """The key of a prefix that ends inside a block covers its full blocks and
    the tail's *length*, not the tail's tokens (both groups use the same key):
    two prompts that differ only in a partial last block share the cached
    tail block and the snapshot after it."""

    def _match(self, prompt):
        kv_len, blocks, keys = self._match_kv(prompt)
        m = self._reconcile(prompt, kv_len, blocks, keys)
        full = len(keys) - 1
        start = full * self.B
        for tail, block in self.kv.children.get(keys[-1], {}).items():
            p = start + len(tail)
            if len(tail) == self.B or p <= m.length or p >= len(prompt):
                continue
            for prefix, slot in self.states.index.items():
                if len(prefix) == p and prefix[:start] == tuple(prompt[:start]):
                    return Match(p, blocks[:full] + [block], slot)
        return m

    return _subclass(factory, "hash-ignores-partial", _match=_match)


@register("cached-before-written", "SNAP")
def cached_before_written(factory):
    """Blocks are registered as full by the tokens the request *knows* (its
    prompt, or a sampled token not computed yet) rather than the tokens
    computed: after a chunk that ends inside a block, that block is published
    as holding all B positions (vllm#34587: a 1866-token chunk against a
    2048-token block hashed as full)."""

    def _register_blocks(self, req):
        B, parent = self.B, ROOT
        known = min(len(req.tokens), len(req.blocks) * B)
        for i in range(known // B):
            tokens = tuple(req.tokens[i * B: (i + 1) * B])
            self.kv.register(parent, tokens, tuple(req.tokens[: (i + 1) * B]), req.blocks[i])
            parent = chain(parent, tokens)

    return _subclass(factory, "cached-before-written", _register_blocks=_register_blocks)


CONV_WIDTH = ModelConfig().conv_width


@register("short-chunk-conv-overwrite", "SNAP")
def short_chunk_conv_overwrite(factory):
    """A chunk shorter than the conv window (conv_width - 1 tokens) that starts
    from a shared snapshot takes the kernel's "shift-only" fast path, which
    updates the state in place through the *source* slot instead of copying
    it first (vllm#56196: the shared prefix's state is overwritten, the
    request's own slot is not written).  The request itself continues
    correctly (it copies the advanced state next step); everyone else who
    reuses that snapshot gets the state of a longer sequence."""

    def _plan_request(self, req, budget):
        step = ReferenceCache._plan_request(self, req, budget)
        if (step is not None and step.state_init.kind == "copy" and step.state_init.source is not None
                and step.end - step.start < CONV_WIDTH - 1):
            req.init = step.state_init  # next step copies what the shared slot now holds
            return replace(step, state_slot=step.state_init.source, state_init=RESUME)
        return step

    return _subclass(factory, "short-chunk-conv-overwrite", _plan_request=_plan_request)


# -- the histories of issue 25: each of these needs one the generator used to reach at some seeds only --

@register("evict-running-entry", "LIFETIME")
def evict_running_entry(factory):
    """A block is queued for eviction when it is published (registered as
    cached) if the request that wrote it is its only holder, as if the cache
    entry's reference were the only one: it waits behind every older cached
    entry, and once eviction reaches it (a new long prompt needs blocks while
    the writer still decodes) the allocation overwrites the KV of a running
    request's prompt, which the request reads at its next step."""

    def _register_blocks(self, req):
        ReferenceCache._register_blocks(self, req)
        for b in req.blocks[: req.computed // self.B]:
            if self.kv.ref[b] == 1 and b in self.kv.meta and b not in self.kv.free:
                self.kv.free[b] = None  # the newest evictable: behind every older cached entry

    return _subclass(factory, "evict-running-entry", _register_blocks=_register_blocks)


def _copied_index(cache, req) -> int | None:
    """The table index of the copy a hit ending inside a block made, while
    the request has not computed that block to its end (None otherwise)."""
    i = getattr(req, "copied", None)
    if i is None or req not in cache.running or req.computed >= min((i + 1) * cache.B, req.prompt_len):
        return None
    return i


def _admit_marking_copy(cache, req, kv_copies) -> bool:
    ok = ReferenceCache._admit(cache, req, kv_copies)
    if ok and req.computed % cache.B:  # the hit ended inside its last block: that block is a copy
        req.copied = req.computed // cache.B
    return ok


@register("abort-publishes-copied-block", "SNAP")
def abort_publishes_copied_block(factory):
    """Aborting a request whose hit ended inside a block publishes its copy of
    that block under the prompt's tokens for the whole block, as if the
    copy-on-write had completed it (the abort path marks the copied block
    computed): aborted before it wrote the block's end, the cache lists
    positions that hold nothing, and a later prompt through that block reads
    them."""

    def abort(self, request_id):
        req = self._find(request_id)
        i = _copied_index(self, req)
        if i is not None and len(req.tokens) >= (i + 1) * self.B:
            parent = ROOT
            for j in range(i):
                parent = chain(parent, tuple(req.tokens[j * self.B: (j + 1) * self.B]))
            self.kv.register(parent, tuple(req.tokens[i * self.B: (i + 1) * self.B]),
                             tuple(req.tokens[: (i + 1) * self.B]), req.blocks[i])
        ReferenceCache.abort(self, request_id)

    return _subclass(factory, "abort-publishes-copied-block", _admit=_admit_marking_copy, abort=abort)


@register("abort-leaks-copy", "LIFETIME")
def abort_leaks_copy(factory):
    """A copy-on-write block is tracked apart until the request completes it;
    an abort before that frees the request's other blocks and forgets the
    copy, which stays referenced by nobody (a leak: a block fewer every time
    a client goes away mid-prefill after a hit ending inside a block)."""

    def abort(self, request_id):
        req = self._find(request_id)
        i = _copied_index(self, req)
        if i is not None:
            req.blocks = req.blocks[:i] + req.blocks[i + 1:]
        ReferenceCache.abort(self, request_id)

    return _subclass(factory, "abort-leaks-copy", _admit=_admit_marking_copy, abort=abort)


@register("resume-from-hit-after-short-chunk", "SNAP")
def resume_from_hit_after_short_chunk(factory):
    """After a hit ending inside a block, a first chunk that stops inside the
    same block leaves the request's state source at the hit's snapshot (the
    core and the worker disagree on the live recurrent column, vllm#51763):
    the next chunk starts again from the state after the hit, not after the
    chunk, and every later token is computed from the wrong state."""

    def _plan_request(self, req, budget):
        step = ReferenceCache._plan_request(self, req, budget)
        if (step is not None and step.state_init.kind == "copy" and step.start % self.B
                and step.end // self.B == step.start // self.B and step.end < req.prompt_len):
            req.init = step.state_init
        return step

    return _subclass(factory, "resume-from-hit-after-short-chunk", _plan_request=_plan_request)


@register("state-hit-over-kv", "GROUPS")
def state_hit_over_kv(factory):
    """The groups' hits are combined by their maximum: when the recurrent
    group holds a longer prefix of the prompt than the attention group (the
    KV was evicted, a deeper snapshot survived; vllm#46453), the request
    starts at the snapshot's length with the KV blocks that were found, and
    the positions between the two were never written in its table."""

    def _reconcile(self, prompt, kv_len, blocks, keys):
        m = ReferenceCache._reconcile(self, prompt, kv_len, blocks, keys)
        for p in range(len(prompt) - 1, m.length, -1):
            slot = self.states.lookup(tuple(prompt[:p]))
            if slot is not None and blocks:
                return Match(p, blocks[: -(-p // self.B)], slot)
        return m

    return _subclass(factory, "state-hit-over-kv", _reconcile=_reconcile)
