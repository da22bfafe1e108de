"""Recurrent state slots and the snapshot registry.

A snapshot is not a slot of its own: it is a registration on the physical slot
a request was extending, made when a step ends exactly at a checkpoint.  The
request then continues in a new slot with copy-before-extend, so the
registered slot is never overwritten (vLLM's "align" mode does the same)."""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int):
        self.ref = [0] * num_slots
        self.free: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.index: dict[tuple[int, ...], int] = {}  # prefix -> slot holding the state after it
        self.snap: dict[int, tuple[int, ...]] = {}  # slot -> prefix
        self.on_evict = None  # callback(slot, prefix) before a snapshot is overwritten (host tier)

    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        if not self.free:
            return None
        slot, _ = self.free.popitem(last=False)
        if self.on_evict is not None and slot in self.snap:
            self.on_evict(slot, self.snap[slot])
        self.unregister(slot)
        self.ref[slot] = 1
        return slot

    def acquire(self, slot: int) -> None:
        self.ref[slot] += 1
        self.free.pop(slot, None)

    def release(self, slot: int) -> None:
        self.ref[slot] -= 1
        if self.ref[slot] < 0:
            raise AssertionError(f"state slot {slot} released below zero")
        if self.ref[slot] == 0:
            self.free[slot] = None
            if slot not in self.snap:
                self.free.move_to_end(slot, last=False)

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
