"""Environment faults: the world misbehaving around a correct cache.

A mutant is a bug in the implementation; an environment fault is a failure of
what the implementation depends on -- here the harness's host store and the
transport between it and device memory (:mod:`conformance.harness.transport`).  A
correct implementation must survive every one of them: right logits (by
treating what it cannot trust as a miss and recomputing), no leaked memory,
and a clear error only where no recovery exists.

Each fault is named, documented and seeded, plugs into the transport's
explicit seams (:class:`~conformance.harness.transport.TransportHooks`) of a
fresh session (``attach``), composes with the others (in the order given),
fires under a :class:`Trigger` (probability, step, request, limit) and
records where it fired, in its report and as an event of the session's
history.  A fault that never fired proves nothing, and neither does one
whose effect nothing consumed (a corrupted offload never read back), so
``run`` fails when a fault is not *exercised*: no firing of it was consumed
(:class:`~conformance.harness.transport.Firing`: its corrupted or failed load
was read or rejected by a computed step, or its failed offload was reported).

On the command line: ``--faults transfer-corrupt,alloc-fail:p=0.2`` with
trigger parameters after colons: ``p=`` probability, ``step=`` only at that
session step, ``request=`` only for transfers on behalf of that request,
``limit=`` at most that many times per session.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from conformance.errors import TransferFailed
from conformance.harness.transport import HostEntry, Payload, TransportHooks

if TYPE_CHECKING:
    from conformance.harness.session import Session

MAX_WHERE = 50  # places recorded per fault (the count keeps going)


@dataclass(frozen=True)
class Trigger:
    probability: float = 0.5
    step: int | None = None  # the session's step number (1-based)
    request: str | None = None
    limit: int | None = None  # fires per session

    @classmethod
    def parse(cls, spec: str) -> Trigger:
        kw: dict[str, Any] = {}
        names = {"p": "probability", **{f.name: f.name for f in fields(cls)}}
        for part in filter(None, spec.split(":")):
            key, sep, value = part.partition("=")
            if not sep or key not in names:
                raise KeyError(f"bad trigger {part!r}: expected p=, step=, request= or limit=")
            field_name = names[key]
            try:
                kw[field_name] = value if field_name == "request" else (
                    float(value) if field_name == "probability" else int(value))
            except ValueError:
                raise KeyError(f"bad trigger value {part!r}") from None
        p = kw.get("probability", cls.probability)
        if not 0.0 <= p <= 1.0:  # NaN fails both comparisons too
            raise KeyError(f"bad trigger value p={p}: a probability is between 0 and 1")
        for key in ("step", "limit"):
            if key in kw and kw[key] < 1:
                raise KeyError(f"bad trigger value {key}={kw[key]}: must be at least 1")
        return cls(**kw)


class Fault(TransportHooks):
    name = ""
    applies_to = "transfer"  # what it needs to fire on, for the "not exercised" hint

    def __init__(self, trigger: Trigger, seed: int):
        self.trigger = trigger
        self.seed = seed
        self.fired = 0
        self.consumed = 0  # firings whose effect reached a computed step or the implementation
        self.opportunities = 0
        self.where: list[dict] = []
        self.session: Session | None = None  # the session it is attached to

    def attach(self, session) -> None:
        self.session = session
        self.fired_here = 0
        session.runner.transport.hooks.append(self)

    def should_fire(self, transfer) -> bool:
        assert self.session is not None, "a fault fires only once attached"
        self.opportunities += 1
        t = self.trigger
        if t.step is not None and self.session.step_no != t.step:
            return False
        if t.request is not None and transfer.request_id != t.request:
            return False
        if t.limit is not None and self.fired_here >= t.limit:
            return False
        # Each decision is seeded by the run's seed and where it happens (not by
        # a stream shared across examples), so replaying a repro's operations
        # replays exactly the faults that fired in it.
        self.rng = random.Random(f"{self.seed}:{self.name}:{self.session.step_no}:"
                                 f"{transfer.id}:{transfer.direction}:{transfer.key}")
        return self.rng.random() < t.probability

    def record(self, transfer, what: str) -> None:
        assert self.session is not None, "a fault fires only once attached"
        self.fired += 1
        self.fired_here += 1
        self.session.runner.transport.fired(self.name, transfer, what, on_consumed=self._consumed)
        if len(self.where) < MAX_WHERE:
            self.where.append({"step": self.session.step_no, "transfer": transfer.id,
                               "direction": transfer.direction, "kind": transfer.kind, "key": transfer.key,
                               "request": transfer.request_id, "what": what})

    def _consumed(self) -> None:
        self.consumed += 1

    def report(self) -> dict:
        return {"fired": self.fired, "consumed": self.consumed, "opportunities": self.opportunities,
                "exercised": self.consumed > 0,
                "where": list(self.where), "description": (type(self).__doc__ or "").strip().split("\n\n")[0],
                "trigger": asdict(self.trigger),
                **({} if self.fired else {"hint": self._silent_hint()})}

    def _silent_hint(self) -> str:
        if self.opportunities:  # offered, but the trigger never chose one
            return (f"{self.opportunities} {self.applies_to}(s) were offered to this fault and its trigger "
                    f"(p={self.trigger.probability}) chose none: raise p or run more examples")
        return (f"no {self.applies_to} was ever offered to this fault: does the implementation use a host tier "
                f"(the reference: --option host_tier=true) and does the check evict (eviction-pressure)?")


# -- the store -------------------------------------------------------------------------------
class AllocFail(Fault):
    """Allocation failure: the host store has no room for an offload, which
    then reports failure.  The implementation must not count the entry as
    stored."""

    name = "alloc-fail"
    applies_to = "offload"

    def refuse_offload(self, transport, transfer):
        if self.should_fire(transfer):
            self.record(transfer, "host allocation refused")
            return True
        return False


class EvictBeforeLoad(Fault):
    """Eviction between lookup and use: the store evicts an entry after the
    implementation decided to load it; the load reports it missing."""

    name = "evict-before-load"
    applies_to = "load"

    def before_lookup(self, transport, transfer):
        if self.should_fire(transfer):
            self.record(transfer, "entry evicted before the load")
            transport.store.drop(transfer.key)


class LostEntry(Fault):
    """A store that loses an entry after answering a lookup: the entry's host
    memory was reused, and the load silently returns another entry's bytes
    (or zeroes) as if nothing happened."""

    name = "lost-entry"
    applies_to = "load"

    def looked_up(self, transport, transfer, entry):
        if entry is None or not self.should_fire(transfer):
            return entry
        others = [e for k, e in transport.store.entries.items()
                  if k != transfer.key and e.payload.kind == entry.payload.kind]
        if others:
            self.record(transfer, "returned another entry's bytes")
            return HostEntry(self.rng.choice(others).payload, entry.checksum)
        self.record(transfer, "returned zeroed bytes")
        zero = Payload(entry.payload.kind, {k: torch.zeros_like(v) for k, v in entry.payload.tensors.items()},
                       entry.payload.prov)
        return HostEntry(zero, entry.checksum)


# -- the wire --------------------------------------------------------------------------------
class TransferFail(Fault):
    """A transfer that fails: nothing usable arrives and the completion says so."""

    name = "transfer-fail"

    def in_flight(self, transport, transfer, payload):
        if self.should_fire(transfer):
            self.record(transfer, "failed")
            raise TransferFailed("injected transfer failure")
        return payload


class TransferPartial(Fault):
    """A transfer that arrives partly (the first half of a block's positions,
    or the conv state without the matrix state) yet completes as if whole."""

    name = "transfer-partial"

    def in_flight(self, transport, transfer, payload):
        if not self.should_fire(transfer):
            return payload
        if payload.kind == "kv":
            n = payload.tensors["kv"].shape[1] // 2
            self.record(transfer, f"only {n} positions arrived")
            return Payload("kv", {"kv": payload.tensors["kv"][:, :n]}, {"kv": payload.prov["kv"][:n]})
        self.record(transfer, "conv state arrived without the matrix state")
        return Payload("state", {"conv": payload.tensors["conv"]}, {"conv": payload.prov["conv"]})


class TransferCorrupt(Fault):
    """A transfer that arrives corrupted: the bytes are perturbed in flight
    and the completion reports success."""

    name = "transfer-corrupt"

    def in_flight(self, transport, transfer, payload):
        if not self.should_fire(transfer):
            return payload
        self.record(transfer, "bytes perturbed")
        gen = torch.Generator().manual_seed(self.rng.randrange(2**31))
        noisy = {k: v + 1e-2 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in payload.tensors.items()}
        return Payload(payload.kind, noisy, payload.prov)


class TransferReorder(Fault):
    """Transfers that complete out of order: a load's data lands, and its
    completion is reported, a step later, and each step's completions come
    back in reverse order.  (Offloads never wait: their source may be reused
    by the very step that evicts it.)"""

    name = "transfer-reorder"
    applies_to = "load"

    def schedule(self, transport, loads):
        now, later = [], []
        for t in loads:
            if self.should_fire(t):
                self.record(t, "completed a step late")
                later.append(t)
            else:
                now.append(t)
        return now, later

    def order(self, done):
        return list(reversed(done))


FAULTS: dict[str, type[Fault]] = {cls.name: cls for cls in (
    AllocFail, EvictBeforeLoad, LostEntry, TransferFail, TransferPartial, TransferCorrupt, TransferReorder)}


class FaultSet:
    """Several faults on one session, composed in the order given."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    def attach(self, session) -> None:
        for f in self.faults:
            f.attach(session)

    def report(self) -> dict[str, dict]:
        return {f.name: f.report() for f in self.faults}


def build_faults(names: tuple[str, ...], seed: int) -> FaultSet:
    """``names``: fault names with optional ``:key=value`` triggers.  Raises
    KeyError naming an unknown fault or a bad trigger."""
    faults = []
    for spec in names:
        name, _, trig = spec.partition(":")
        if name not in FAULTS:
            raise KeyError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        faults.append(FAULTS[name](Trigger.parse(trig), seed))
    if len({f.name for f in faults}) != len(faults):
        raise KeyError("a fault is named twice")
    return FaultSet(faults)
