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
            if self.kv.ref[b] > 0:
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
