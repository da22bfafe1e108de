"""The harness's second tier: a host store and the transport that moves KV
blocks and state slots between it and device memory.

Both are owned by the harness, like device memory: an implementation only
names entries (:class:`~conformance.contract.Transfer`) and learns outcomes
(:class:`~conformance.contract.TransferDone`).  Environment faults
(:mod:`fault_injection.environment`) plug into the explicit seams a real tier
has, as :class:`TransportHooks`: the store (an offload refused for want of
room, an entry evicted between lookup and use, a lookup answered with other
bytes) and the wire (each payload in flight; which loads complete now and in
what order).  Each firing is an event of the session's history.

Provenance travels with the bytes, so a load that lands stale data shows up
in the invariants and explanations like any other stale memory; corruption
in flight changes the bytes but not the provenance, so only the logits (or an
implementation's checksum) can tell.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from conformance.contract import Transfer, TransferDone
from conformance.errors import ContractError, TransferFailed
from conformance.harness.memory import Memory

if TYPE_CHECKING:
    from conformance.harness.history import History


@dataclass
class Payload:
    """What one transfer moves: tensors by part, with their provenance."""

    kind: str  # "kv" | "state"
    tensors: dict[str, torch.Tensor]  # kv: {"kv": [layers, B, 2, H, D]}; state: {"conv": .., "ssm": ..}
    prov: dict[str, Any]  # kv: {"kv": [prefix per offset]}; state: {"conv": prefix, "ssm": prefix}

    def clone(self) -> Payload:
        return Payload(self.kind, {k: v.clone() for k, v in self.tensors.items()},
                       {k: (list(v) if isinstance(v, list) else v) for k, v in self.prov.items()})


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class HostEntry:
    payload: Payload
    checksum: str  # of the source bytes, computed before they left the device
    # Whether the bytes stored are the source bytes (False: the offload was
    # corrupted or cut short in flight).  The harness's own knowledge: no load
    # of such an entry can verify, so no correct cache can reuse it.
    intact: bool = True
    # The window group whose layers' KV the entry holds (None: the full attention layers', or a state):
    # the offload's ``Transfer.window_group``
    window_group: int | None = None


class HostStore:
    """Host memory: entries by key.  Unbounded unless ``capacity`` is set."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.entries: dict[str, HostEntry] = {}

    def put(self, key: str, entry: HostEntry) -> bool:
        """False when the store cannot allocate room for the entry."""
        if self.capacity is not None and key not in self.entries and len(self.entries) >= self.capacity:
            return False
        self.entries[key] = entry
        return True

    def get(self, key: str) -> HostEntry | None:
        return self.entries.get(key)

    def drop(self, key: str) -> None:
        self.entries.pop(key, None)


class TransportHooks:
    """The seams of the transport, for environment faults.  Every method is a
    no-op here; a fault overrides the seams it acts on.  ``transfer`` is always
    the transfer being executed, passed explicitly."""

    def refuse_offload(self, transport: Transport, transfer: Transfer) -> bool:
        """Store seam: True when the host store has no room for this offload."""
        return False

    def before_lookup(self, transport: Transport, transfer: Transfer) -> None:
        """Store seam: between a load's decision and its lookup (evict here)."""

    def looked_up(self, transport: Transport, transfer: Transfer, entry: HostEntry | None) -> HostEntry | None:
        """Store seam: what the lookup answers (another entry's bytes, say)."""
        return entry

    def in_flight(self, transport: Transport, transfer: Transfer, payload: Payload) -> Payload:
        """Wire seam: the bytes as they arrive; may raise TransferFailed."""
        return payload

    def schedule(self, transport: Transport, loads: list[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
        """Wire seam: which loads complete this step (now) and which later."""
        return loads, []

    def order(self, done: list[TransferDone]) -> list[TransferDone]:
        """Wire seam: the order in which this step's completions are reported."""
        return done

    def release(self, transport: Transport, due: list[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
        """Wire seam: which transfers deferred by earlier steps complete now and
        which keep waiting (by default all complete at the next step)."""
        return due, []


@dataclass
class Firing:
    """One fault firing whose effect has not been consumed yet.  It is
    consumed (once) when what it did reaches the implementation or a step:
    the bytes of the load it hit are read by a computed step; the request the
    load was for is computed (it used the bytes, or rejected them and
    recomputed); an offload it made fail is reported failed; an offload whose
    stored bytes it changed is loaded and that load is consumed.  A firing
    on an offload that is never read back is never consumed."""

    on_consumed: object  # zero-argument callable (the fault counts it)
    done: bool = False

    def consume(self) -> None:
        if not self.done:
            self.done = True
            self.on_consumed()  # type: ignore[operator]


@dataclass
class Transport:
    memory: Memory
    store: HostStore = field(default_factory=HostStore)
    hooks: list[TransportHooks] = field(default_factory=list)  # environment faults, in composition order
    history: History | None = None  # where completions and fault firings are recorded
    deferred: list[Transfer] = field(default_factory=list)
    executed: int = 0
    succeeded: dict = field(default_factory=lambda: {"offload": 0, "load": 0})  # completions reporting ok
    loaded_states: set = field(default_factory=set)  # prefixes of the states loads brought to the device
    # Per completed load: whether the bytes that landed are the source bytes
    # the store was given at offload (False: broken on the wire, or a copy
    # broken at rest, or another entry's bytes).  A verifying cache rejects
    # exactly these; the expected-hit oracle excuses their requests.
    intact: dict = field(default_factory=dict)
    # Fault firings awaiting consumption (see Firing): by the transfer they fired on
    # (until it completes), by host key (an offload's stored bytes, until loaded),
    # by load id (its landed bytes, until read) and by request (until computed).
    _pending: dict = field(default_factory=dict)
    _by_key: dict = field(default_factory=dict)
    _by_load: dict = field(default_factory=dict)
    _by_request: dict = field(default_factory=dict)

    def busy(self) -> bool:
        """Transfers issued but not completed yet."""
        return bool(self.deferred)

    def run(self, transfers: tuple[Transfer, ...]) -> list[TransferDone]:
        """Execute what is due: transfers deferred by an earlier step first,
        then this step's offloads (their sources may be reused by this very
        step, so they never wait), then its loads."""
        due, self.deferred = self.deferred, []
        for hook in self.hooks:
            due, wait = hook.release(self, due)
            self.deferred += wait
        offloads = [t for t in transfers if t.direction == "offload"]
        loads = [t for t in transfers if t.direction == "load"]
        for hook in self.hooks:
            loads, later = hook.schedule(self, loads)
            self.deferred += later
        done = [self._execute(t) for t in offloads + due + loads]
        by_id = {t.id: t for t in offloads + due + loads}
        for d in done:
            self.succeeded[by_id[d.id].direction] += d.ok
            self._follow(by_id[d.id], d)
        for hook in self.hooks:
            done = hook.order(done)
        return done

    # -- one transfer ------------------------------------------------------------------
    def _execute(self, t: Transfer) -> TransferDone:
        self.executed += 1
        try:
            if t.direction == "offload":
                payload = self.read(t.kind, t.device, t.window_group)
                entry = HostEntry(payload, checksum(payload.tensors), window_group=t.window_group)
                entry.payload = self._fly(t, payload.clone())
                entry.intact = checksum(entry.payload.tensors) == entry.checksum
                if any(hook.refuse_offload(self, t) for hook in self.hooks) or not self.store.put(t.key, entry):
                    return TransferDone(t.id, False, error="host store full")
                return TransferDone(t.id, True, entry.checksum)
            for hook in self.hooks:
                hook.before_lookup(self, t)
            found = self.store.get(t.key)
            for hook in self.hooks:
                found = hook.looked_up(self, t, found)
            if found is None:
                return TransferDone(t.id, False, error=f"no host entry {t.key!r}")
            self.write(t.kind, t.device, self._fly(t, found.payload.clone()), t.window_group)
            origin = self.memory.state_origin if t.kind == "state" else \
                self.memory.kv_origin if t.window_group is None else self.memory.win_origin[t.window_group]
            origin[t.device] = t.id
            landed = self.read(t.kind, t.device, t.window_group)
            done = TransferDone(t.id, True, checksum(landed.tensors))
            self.intact[t.id] = done.checksum == found.checksum
            if t.kind == "state" and self.intact[t.id]:  # arrived whole and intact
                self.loaded_states.add(landed.prov["ssm"])
            return done
        except TransferFailed as exc:
            return TransferDone(t.id, False, error=str(exc) or "transfer failed")

    def _follow(self, t: Transfer, d: TransferDone) -> None:
        """Where the firings on ``t`` (and on the offload a load reads back) go to be consumed."""
        firings = self._pending.pop(t.id, [])
        if t.direction == "offload":
            if not d.ok:
                for f in firings:  # the failure is reported to update() this very step
                    f.consume()
            else:
                self._by_key[t.key] = firings  # a later offload of the key replaces the bytes
            return
        firings += self._by_key.pop(t.key, []) if d.ok else []
        if d.ok:
            self._by_load[t.id] = firings
        self._by_request.setdefault(t.request_id, []).extend(firings)

    def computed(self, request_id: str, loads_read: frozenset[int]) -> None:
        """A step of ``request_id`` ran, reading the bytes of ``loads_read``."""
        for load in loads_read:
            for f in self._by_load.pop(load, []):
                f.consume()
        for key in (request_id, None):  # a load for no named request: the next step consumes it
            for f in self._by_request.pop(key, []):
                f.consume()

    def _fly(self, t: Transfer, payload: Payload) -> Payload:
        for hook in self.hooks:
            payload = hook.in_flight(self, t, payload)
        return payload

    def fired(self, fault: str, transfer: Transfer, what: str, on_consumed=None) -> None:
        """A fault fired on ``transfer``: an event of the history.  ``on_consumed``
        is called once the firing's effect is consumed (see :class:`Firing`)."""
        if self.history is not None:
            self.history.fault(fault, transfer, what)
        if on_consumed is not None and transfer is not None:
            self._pending.setdefault(transfer.id, []).append(Firing(on_consumed))

    # -- device side -------------------------------------------------------------------
    def _group(self, group: int | None) -> None:
        if group is not None and not 0 <= group < len(self.memory.windows):
            raise ContractError(f"window group {group}: the model has {len(self.memory.windows)} window groups")

    def read(self, kind: str, device: int, group: int | None = None) -> Payload:
        """A block's KV for the full layers (``group`` None) or a window group's layers; a slot's state."""
        mem = self.memory
        if kind == "kv":
            mem.check_block(device)
            self._group(group)
            store = mem.kv if group is None else mem.win[group]
            return Payload("kv", {"kv": store[:, device].clone()}, {"kv": list(mem.prov_rows(group)[device])})
        mem.check_slot(device)
        return Payload("state", {"conv": mem.conv[:, device].clone(), "ssm": mem.ssm[:, device].clone()},
                       {"conv": mem.conv_prov[device], "ssm": mem.ssm_prov[device]})

    def write(self, kind: str, device: int, payload: Payload, group: int | None = None) -> None:
        """Writes the parts (and, for KV, the leading positions) the payload holds."""
        mem = self.memory
        if kind != payload.kind:
            raise ContractError(f"a {payload.kind} entry cannot be loaded into a {kind} location")
        if kind == "kv":
            mem.check_block(device)
            self._group(group)
            store = mem.kv if group is None else mem.win[group]
            n = payload.tensors["kv"].shape[1]
            if store.shape[0] != payload.tensors["kv"].shape[0]:
                raise ContractError(f"a KV entry of {payload.tensors['kv'].shape[0]} layers cannot be loaded into "
                                    f"{'the full attention' if group is None else f'window group {group}'}'s "
                                    f"{store.shape[0]} layers")
            store[:, device, :n] = payload.tensors["kv"]
            rows = mem.prov_rows(group)
            for off in range(n):  # the page's other groups lose what they held there
                prefix = payload.prov["kv"][off]
                mem.clobber(group, device, off, 1, prefix or (), len(prefix) - 1 if prefix else 0)
            rows[device][:n] = payload.prov["kv"][:n]
            return
        mem.check_slot(device)
        for part, store, prov in (("conv", mem.conv, mem.conv_prov), ("ssm", mem.ssm, mem.ssm_prov)):
            if part in payload.tensors:
                store[:, device] = payload.tensors[part]
                prov[device] = payload.prov[part]
