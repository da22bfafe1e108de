"""Transfers under the generator's control: the wire of the host tier as a
sequence of decisions, each one an operation of the history.

Environment faults (``fault_injection.environment``) decide by seeded chance;
Hypothesis cannot search or shrink a chance.  :class:`TransferControl` is a
:class:`~conformance.harness.transport.TransportHooks` whose every decision
comes from an operation (:mod:`conformance.harness.ops`):

- ``HoldTransfers``: loads stop completing in the step that issued them; each
  lands at the start of the next step (the window in which the generator can
  evict, claim the same prefix, abort, or decide);
- ``Deliver(pick, outcome, delay)``: one pending load completes ``delay`` steps
  later than it would have, whole, failed or short, and loads due together are
  reported in the order of their decisions (out of order when a later load is
  decided first);
- ``StoreEvict(pick)``: the host store drops the entry a pending load is about
  to read (the store answered the lookup; the entry is gone at the load).

Offloads are never held: their source may be reused by the very step that
evicts it.  Every decision that acts is recorded as a ``fault`` event named
``control``, so a repro's explanation shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.contract import Transfer, TransferDone
from conformance.errors import TransferFailed
from conformance.harness.transport import Payload, Transport, TransportHooks

NAME = "control"


@dataclass
class Fate:
    outcome: str
    delay: int
    order: int  # the decision's sequence number: completions due together are reported in this order


@dataclass
class TransferControl(TransportHooks):
    holding: bool = False
    fates: dict[int, Fate] = field(default_factory=dict)  # transfer id -> its decided fate
    decisions: int = 0
    # What the generator made happen (coverage counts them).
    counts: dict[str, int] = field(default_factory=lambda: {"held": 0, "delivered": 0, "failed": 0, "short": 0,
                                                            "delayed": 0, "reordered": 0, "store_evicted": 0})

    @staticmethod
    def of(transport: Transport) -> TransferControl:
        """The transport's controller, installed (first among its hooks) on first use."""
        for hook in transport.hooks:
            if isinstance(hook, TransferControl):
                return hook
        control = TransferControl()
        transport.hooks.insert(0, control)
        return control

    @staticmethod
    def pending(transport: Transport) -> list[Transfer]:
        """Loads issued and not completed, by transfer id."""
        return sorted((t for t in transport.deferred if t.direction == "load"), key=lambda t: t.id)

    # -- operations ---------------------------------------------------------------------
    def hold(self) -> None:
        self.holding = True

    def deliver(self, transport: Transport, pick: int, outcome: str, delay: int) -> None:
        pending = [t for t in self.pending(transport) if t.id not in self.fates]  # each load is decided once
        if not pending:
            return
        t = pending[pick % len(pending)]
        self.decisions += 1
        self.fates[t.id] = Fate(outcome, delay, self.decisions)
        if delay:
            self.counts["delayed"] += 1
        transport.fired(NAME, t, f"decided: {outcome}" + (f" after {delay} more steps" if delay else ""))

    def store_evict(self, transport: Transport, pick: int) -> None:
        pending = self.pending(transport)
        if not pending:
            return
        t = pending[pick % len(pending)]
        if transport.store.get(t.key) is not None:
            transport.store.drop(t.key)
            self.counts["store_evicted"] += 1
            transport.fired(NAME, t, "host entry evicted after the lookup")

    # -- the seams -----------------------------------------------------------------------
    def schedule(self, transport, loads):
        if not self.holding or not loads:
            return loads, []
        self.counts["held"] += len(loads)
        return [], loads

    def release(self, transport, due):
        now, wait = [], []
        for t in due:
            fate = self.fates.get(t.id)
            if fate is not None and fate.delay > 0:
                fate.delay -= 1
                wait.append(t)
            else:
                now.append(t)
        # decided loads first, in the order of their decisions; then the rest by id
        now.sort(key=lambda t: (self.fates[t.id].order if t.id in self.fates else self.decisions + 1, t.id))
        if [t.id for t in now] != sorted(t.id for t in now):
            self.counts["reordered"] += 1
        return now, wait

    def in_flight(self, transport, transfer, payload: Payload) -> Payload:
        fate = self.fates.pop(transfer.id, None) if transfer.direction == "load" else None
        if fate is None:
            if transfer.direction == "load" and self.holding:
                self.counts["delivered"] += 1
            return payload
        if fate.outcome == "fail":
            self.counts["failed"] += 1
            transport.fired(NAME, transfer, "failed")
            raise TransferFailed("the generator failed this load")
        if fate.outcome == "short":
            self.counts["short"] += 1
            transport.fired(NAME, transfer, "delivered short")
            if payload.kind == "kv":
                n = payload.tensors["kv"].shape[1] // 2
                return Payload("kv", {"kv": payload.tensors["kv"][:, :n]}, {"kv": payload.prov["kv"][:n]})
            return Payload("state", {"conv": payload.tensors["conv"]}, {"conv": payload.prov["conv"]})
        self.counts["delivered"] += 1
        return payload

    def order(self, done: list[TransferDone]) -> list[TransferDone]:
        return done  # release() already put the due loads in decision order
