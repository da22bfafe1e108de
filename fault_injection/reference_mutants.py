"""Seeded bugs in the reference cache, each a subclass overriding exactly the
one decision it breaks.  They reproduce the failure classes of the design
note and of ``upstream-bugs.md``; the suite must catch them through its
general checks, never through a check written for one of them."""

from __future__ import annotations

from conformance.adapters.reference.cache import Match, ReferenceCache
from conformance.contract import copy_from

from .registry import register


def _subclass(factory, name: str, **methods):
    if not (isinstance(factory, type) and issubclass(factory, ReferenceCache)):
        raise TypeError(f"mutant {name} applies to the reference implementation only")
    return type(f"{factory.__name__}[{name}]", (factory,), methods)


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

    def _free(self, req):
        for b in req.blocks:
            if self.kv.ref[b] > 0:
                self.kv.ref[b] = 1
            self.kv.release(b)
        req.blocks = []
        if req.slot is not None:
            self.states.release(req.slot)
        req.slot = None
        if req in self.running:
            self.running.remove(req)

    return _subclass(factory, "free-while-referenced", _free=_free)
