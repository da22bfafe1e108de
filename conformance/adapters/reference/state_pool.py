"""Recurrent state slots and the snapshot registry.

A snapshot is not a slot of its own: it is a registration on the physical slot
a request was extending, made when a step ends exactly at a checkpoint.  The
request then continues in a new slot with copy-before-extend, so the
registered slot is never overwritten (vLLM's "align" mode does the same)."""

from __future__ import annotations

from conformance.adapters.reference.ref_pool import RefPool


class StatePool(RefPool):
    what = "state slot"

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.index: dict[tuple[int, ...], int] = {}  # prefix -> slot holding the state after it
        self.snap: dict[int, tuple[int, ...]] = {}  # slot -> prefix

    def content(self, slot: int):
        return self.snap.get(slot)

    def register(self, prefix: tuple[int, ...], slot: int) -> bool:
        if prefix in self.index or slot in self.snap:
            return False
        self.index[prefix] = slot
        self.snap[slot] = prefix
        return True

    def unregister(self, slot: int) -> None:
        prefix = self.snap.pop(slot, None)
        if prefix is not None and self.index.get(prefix) == slot:
            del self.index[prefix]

    def lookup(self, prefix: tuple[int, ...]) -> int | None:
        return self.index.get(prefix)
