"""Environment faults: the world misbehaving around a correct cache.

A mutant is a bug in the implementation; an environment fault is a failure of
what the implementation depends on -- here the harness's host store and the
transport between it and device memory (:mod:`conformance.transport`).  A
correct implementation must survive every one of them: right logits (by
treating what it cannot trust as a miss and recomputing), no leaked memory,
and a clear error only where no recovery exists.

Each fault is named, documented and seeded, interposes on one seam of a
fresh session (``attach``), composes with the others (they chain), fires
under a :class:`Trigger` (probability, step, request, limit) and records
where it fired.  A fault that never fired proves nothing, so ``run`` fails
when one is not exercised.

On the command line: ``--faults transfer-corrupt,alloc-fail:p=0.2`` with
trigger parameters after colons: ``p=`` probability, ``step=`` only at that
session step, ``request=`` only for transfers on behalf of that request,
``limit=`` at most that many times per session.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

import torch

from conformance.transport import HostEntry, Payload, TransferFailed

MAX_WHERE = 50  # places recorded per fault (the count keeps going)


@dataclass(frozen=True)
class Trigger:
    probability: float = 0.5
    step: int | None = None  # the session's step number (1-based)
    request: str | None = None
    limit: int | None = None  # fires per session

    @classmethod
    def parse(cls, spec: str) -> "Trigger":
        kw = {}
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
        return cls(**kw)


class Fault:
    name = ""
    applies_to = "transfer"  # what it needs to fire on, for the "not exercised" hint

    def __init__(self, trigger: Trigger, seed: int):
        self.trigger = trigger
        self.seed = seed
        self.fired = 0
        self.opportunities = 0
        self.where: list[dict] = []
        self.session = None

    def attach(self, session) -> None:
        self.session = session
        self.fired_here = 0
        self.install(session.runner.transport)

    def install(self, transport) -> None:
        raise NotImplementedError

    def should_fire(self, transfer) -> bool:
        self.opportunities += 1
        t = self.trigger
        if t.step is not None and self.session.coverage.get("steps") != t.step:
            return False
        if t.request is not None and transfer.request_id != t.request:
            return False
        if t.limit is not None and self.fired_here >= t.limit:
            return False
        # Each decision is seeded by the run's seed and where it happens (not by
        # a stream shared across examples), so replaying a repro's operations
        # replays exactly the faults that fired in it.
        self.rng = random.Random(f"{self.seed}:{self.name}:{self.session.coverage.get('steps')}:"
                                 f"{transfer.id}:{transfer.direction}:{transfer.key}")
        return self.rng.random() < t.probability

    def firing(self, transport):
        """At a store seam (which sees keys, not transfers): the transfer being
        executed when this fault fires on it, else None."""
        t = _current(transport)
        return t if t is not None and self.should_fire(t) else None

    def record(self, transfer, what: str) -> None:
        self.fired += 1
        self.fired_here += 1
        if len(self.where) < MAX_WHERE:
            self.where.append({"step": self.session.coverage.get("steps"), "transfer": transfer.id,
                               "direction": transfer.direction, "kind": transfer.kind, "key": transfer.key,
                               "request": transfer.request_id, "what": what})

    def report(self) -> dict:
        return {"fired": self.fired, "opportunities": self.opportunities, "exercised": self.fired > 0,
                "where": list(self.where), "description": (type(self).__doc__ or "").strip().split("\n\n")[0],
                "trigger": asdict(self.trigger),
                **({} if self.fired else {"hint": f"no {self.applies_to} was ever offered to this fault: does the "
                                                  f"implementation use a host tier (the reference: "
                                                  f"--option host_tier=true) and does the check evict "
                                                  f"(eviction-pressure)?"})}


# -- the store -------------------------------------------------------------------------------
class AllocFail(Fault):
    """Allocation failure: the host store has no room for an offload, which
    then reports failure.  The implementation must not count the entry as
    stored."""

    name = "alloc-fail"
    applies_to = "offload"

    def install(self, transport):
        store, put = transport.store, transport.store.put
        fault = self

        def failing_put(key, entry):
            t = fault.firing(transport)
            if t is not None:
                fault.record(t, "host allocation refused")
                return False
            return put(key, entry)

        store.put = failing_put


class EvictBeforeLoad(Fault):
    """Eviction between lookup and use: the store evicts an entry after the
    implementation decided to load it; the load reports it missing."""

    name = "evict-before-load"
    applies_to = "load"

    def install(self, transport):
        store, get = transport.store, transport.store.get
        fault = self

        def evicting_get(key):
            t = fault.firing(transport)
            if t is not None:
                fault.record(t, "entry evicted before the load")
                store.drop(key)
            return get(key)

        store.get = evicting_get


class LostEntry(Fault):
    """A store that loses an entry after answering a lookup: the entry's host
    memory was reused, and the load silently returns another entry's bytes
    (or zeroes) as if nothing happened."""

    name = "lost-entry"
    applies_to = "load"

    def install(self, transport):
        store, get = transport.store, transport.store.get
        fault = self

        def losing_get(key):
            entry = get(key)
            t = fault.firing(transport) if entry is not None else None
            if t is None:
                return entry
            others = [e for k, e in store.entries.items() if k != key and e.payload.kind == entry.payload.kind]
            if others:
                fault.record(t, "returned another entry's bytes")
                return HostEntry(fault.rng.choice(others).payload, entry.checksum)
            fault.record(t, "returned zeroed bytes")
            zero = Payload(entry.payload.kind, {k: torch.zeros_like(v) for k, v in entry.payload.tensors.items()},
                           entry.payload.prov)
            return HostEntry(zero, entry.checksum)

        store.get = losing_get


# -- the wire --------------------------------------------------------------------------------
class TransferFail(Fault):
    """A transfer that fails: nothing usable arrives and the completion says so."""

    name = "transfer-fail"

    def install(self, transport):
        def hook(tr, t, payload):
            if self.should_fire(t):
                self.record(t, "failed")
                raise TransferFailed("injected transfer failure")
            return payload

        transport.in_flight.append(hook)


class TransferPartial(Fault):
    """A transfer that arrives partly (the first half of a block's positions,
    or the conv state without the matrix state) yet completes as if whole."""

    name = "transfer-partial"

    def install(self, transport):
        def hook(tr, t, payload):
            if not self.should_fire(t):
                return payload
            if payload.kind == "kv":
                n = payload.tensors["kv"].shape[1] // 2
                self.record(t, f"only {n} positions arrived")
                return Payload("kv", {"kv": payload.tensors["kv"][:, :n]}, {"kv": payload.prov["kv"][:n]})
            self.record(t, "conv state arrived without the matrix state")
            return Payload("state", {"conv": payload.tensors["conv"]}, {"conv": payload.prov["conv"]})

        transport.in_flight.append(hook)


class TransferCorrupt(Fault):
    """A transfer that arrives corrupted: the bytes are perturbed in flight
    and the completion reports success."""

    name = "transfer-corrupt"

    def install(self, transport):
        def hook(tr, t, payload):
            if not self.should_fire(t):
                return payload
            self.record(t, "bytes perturbed")
            gen = torch.Generator().manual_seed(self.rng.randrange(2**31))
            noisy = {k: v + 1e-2 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in payload.tensors.items()}
            return Payload(payload.kind, noisy, payload.prov)

        transport.in_flight.append(hook)


class TransferReorder(Fault):
    """Transfers that complete out of order: a load's data lands, and its
    completion is reported, a step later, and each step's completions come
    back in reverse order.  (Offloads never wait: their source may be reused
    by the very step that evicts it.)"""

    name = "transfer-reorder"
    applies_to = "load"

    def install(self, transport):
        fault = self

        class Scheduler:
            def __call__(self, tr, loads):
                now, later = [], []
                for t in loads:
                    if fault.should_fire(t):
                        fault.record(t, "completed a step late")
                        later.append(t)
                    else:
                        now.append(t)
                return now, later

            @staticmethod
            def order(done):
                return list(reversed(done))

        transport.schedulers.append(Scheduler())


def _current(transport):
    """The transfer being executed (the store seams see keys, the trigger wants the transfer)."""
    return getattr(transport, "current", None)


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

    def not_exercised(self) -> list[str]:
        return [f.name for f in self.faults if not f.fired]


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
