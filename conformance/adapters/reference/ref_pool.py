"""Refcounted ids (KV blocks, state slots) with LRU reuse of free ones."""

from __future__ import annotations

from collections import OrderedDict


class RefPool:
    """Free ids wait in LRU order.  A free id holding cached content is handed
    out last, oldest first; one holding nothing worth keeping goes first, so
    cached content lives as long as it can.  Subclasses say what an id holds
    (``content``) and how to forget it (``unregister``)."""

    what = "id"

    def __init__(self, size: int):
        self.ref = [0] * size
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(size))
        self.on_evict = None  # callback(id, content) before cached content is overwritten (host tier)

    def content(self, ident: int):
        raise NotImplementedError

    def unregister(self, ident: int) -> None:
        raise NotImplementedError

    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        if not self.free:
            return None
        ident, _ = self.free.popitem(last=False)
        held = self.content(ident)
        if self.on_evict is not None and held is not None:
            self.on_evict(ident, held)
        self.unregister(ident)
        self.ref[ident] = 1
        return ident

    def acquire(self, ident: int) -> None:
        """Take a reference on an id found in the cache."""
        self.ref[ident] += 1
        self.free.pop(ident, None)

    def release(self, ident: int) -> None:
        self.ref[ident] -= 1
        if self.ref[ident] < 0:
            raise AssertionError(f"{self.what} {ident} released below zero")
        if self.ref[ident] == 0:
            self.free[ident] = None
            if self.content(ident) is None:
                self.free.move_to_end(ident, last=False)
