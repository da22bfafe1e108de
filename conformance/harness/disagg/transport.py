"""The transfer interface between the prefill and the decode worker, and the
machinery both implementations share.

A transport registers the two workers' memories, exchanges their metadata
(:class:`~.contract.Handshake`), takes :class:`~.contract.DisaggTransfer`
descriptor lists and moves the bytes: one chunk (one transfer handle) per
:meth:`Transport.progress` call, so a transfer of k chunks is in flight for k
engine steps and other requests run meanwhile.  The decode side learns of a
transfer once -- a :class:`~.contract.TransferNotice` when every chunk
completed or the first one failed; a transfer whose notification never
arrives produces no notice at all (NIXL has no timeout: the receiver needs
its own deadline).  Failures are reported, never raised into the harness.

Subclasses provide only the wire: :meth:`_post` (post one handle and wait for
it), :meth:`_notified` (did the target receive this tag), :meth:`_kill_peer`.
Every notice and every fault event names the transport that ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conformance.disagg.contract import ChunkNotice, Descriptor, DisaggTransfer, Handshake, TransferNotice
from conformance.disagg.geometry import WorkerGeometry
from conformance.harness.history import FaultFired, History

from .faults import FaultSpec
from .ledger import ChunkLedger, digest
from .worker_memory import WorkerMemory

# How long the decode side waits for a chunk's notification after the post completed.  With
# UCX's cma a post completes synchronously and the notification follows within milliseconds;
# NIXL itself has no timeout, so without this a lost notification would hang the receiver.
NOTIFY_DEADLINE_S = 2.0


class TransferError(Exception):
    """A handle failed: ``kind`` is the NIXL error class name (or the in-process equivalent)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class _Flight:
    transfer: DisaggTransfer
    index: int  # submission index (what FaultSpec.transfer counts)
    next_chunk: int = 0
    chunks: list[ChunkNotice] = field(default_factory=list)
    silent: bool = False  # its notification was lost: no notice, ever


class Transport:
    name = "abstract"

    def __init__(self, faults: tuple[FaultSpec, ...] = ()):
        self.faults = tuple(faults)
        self.events: list[FaultFired] = []  # every firing, over every session on this transport
        self.history: History | None = None  # the session's record, where each firing also goes
        self.prefill: WorkerMemory  # set by open()
        self.decode: WorkerMemory
        self._flights: list[_Flight] = []
        self._submitted = 0
        self._held: list[tuple[TransferNotice, int]] = []  # reordered notices and the ticks they waited
        self.stats = {"transfers": 0, "chunks": 0, "bytes": 0, "failed": 0}

    # -- the interface -----------------------------------------------------------------
    def open(self, prefill: WorkerMemory, decode: WorkerMemory) -> Handshake:
        """Register both memories and exchange metadata; returns what each side learned."""
        self.prefill, self.decode = prefill, decode
        self._connect()
        if prefill.geometry.layout.state_dtype != decode.geometry.layout.state_dtype and self._fires("dtype-mismatch"):
            self._event("dtype-mismatch", None,
                        f"metadata exchange: prefill state {prefill.geometry.layout.state_dtype}, "
                        f"decode state {decode.geometry.layout.state_dtype}")
        return Handshake(prefill=self._remote_geometry(prefill.geometry), decode=decode.geometry,
                         transport=self.name)

    def submit(self, transfer: DisaggTransfer) -> None:
        self._flights.append(_Flight(transfer, self._submitted))
        self._submitted += 1
        self.stats["transfers"] += 1

    def arm(self, kind: str) -> None:
        """Fire ``kind`` on the next transfer submitted (a state-machine rule's way in)."""
        self.faults += (FaultSpec(kind, self._submitted),)

    def reset(self) -> None:
        """Forget transfers in flight and armed faults (a new session on the same memory)."""
        self._flights.clear()
        self._held.clear()
        self.faults = tuple(f for f in self.faults if f.kind == "dtype-mismatch")
        self._submitted = 0

    def in_flight(self) -> tuple[int, ...]:
        return tuple(f.transfer.id for f in self._flights)

    def progress(self) -> list[TransferNotice]:
        """Post the next chunk of every transfer in flight; return the notices
        the decode side received (in delivery order)."""
        out: list[TransferNotice] = []
        for f in list(self._flights):
            notice = self._advance(f)
            if notice is None:
                continue
            self._flights.remove(f)
            if f.silent:
                continue
            if self._fires("reorder-completions", f):
                self._event("reorder-completions", f, "notice held back until a later transfer's")
                self._held.append((notice, 0))
                continue
            out.append(notice)
        # held notices go out after a later one (or after 3 quiet steps)
        keep = []
        for notice, waited in self._held:
            if out or waited >= 3:
                out.append(notice)
            else:
                keep.append((notice, waited + 1))
        self._held = keep
        return out

    def close(self) -> None:
        pass

    # -- the wire (subclasses) -----------------------------------------------------------
    def _connect(self) -> None:
        raise NotImplementedError

    def _remote_geometry(self, g: WorkerGeometry) -> WorkerGeometry:
        return g

    def _post(self, op: str, descriptors: tuple[Descriptor, ...], tag: bytes) -> None:
        raise NotImplementedError

    def _notified(self, tag: bytes) -> bool:
        raise NotImplementedError

    def _kill_peer(self) -> str:
        raise NotImplementedError

    # -- shared machinery ----------------------------------------------------------------
    def _fires(self, kind: str, flight: _Flight | None = None) -> bool:
        return any(s.kind == kind and (flight is None or s.transfer == flight.index) for s in self.faults)

    def _event(self, kind: str, flight: _Flight | None, where: str) -> None:
        event = FaultFired(kind, where, flight.transfer if flight else None, self.name)
        self.events.append(event)
        if self.history is not None:
            self.history.record(event)

    def _advance(self, f: _Flight) -> TransferNotice | None:
        t = f.transfer
        k = f.next_chunk
        last = k == len(t.chunks) - 1
        intended = t.chunks[k]
        descs = list(intended)
        if k == 1 and self._fires("kill-peer", f):
            self._event("kill-peer", f, f"peer process killed after chunk 0 of {len(t.chunks)}: {self._kill_peer()}")
        if self._fires("drop-descriptor", f) and k == 0 and len(descs) > 1:
            i = len(descs) // 2
            d = descs.pop(i)
            self._event("drop-descriptor", f, f"chunk 0 descriptor {i} "
                        f"({self.decode.where(d.dst_offset)}, {d.length} bytes) never posted")
        if self._fires("truncate-tail", f) and last:
            d = descs[-1]
            descs[-1] = Descriptor(d.src_offset, d.dst_offset, d.length // 2)
            self._event("truncate-tail", f, f"chunk {k} last descriptor moved {d.length // 2} of {d.length} bytes "
                        f"(ends in {self.decode.where(d.dst_offset + d.length - 1)})")
        tag = f"t{t.id}c{k}".encode()
        if last and self._fires("lose-notification", f):
            # Notifications go to the target: under WRITE that is the decode side, which then
            # never hears of the transfer; under READ the prefill side loses it (decode's own
            # completion status still arrives).
            f.silent = t.op == "WRITE"
            self._event("lose-notification", f, f"chunk {k} posted without a notification "
                        f"({'decode' if f.silent else 'prefill'} side never notified)")
        src_digest = digest(self.prefill, [(d.src_offset, d.length) for d in intended])
        ledger = ChunkLedger(self.prefill, self.decode, tuple(descs), t.id, t.request_id)
        error = ""
        try:
            self._post(t.op, tuple(descs), b"" if f.silent else tag)
        except TransferError as e:
            error = f"{e.kind}: {e}"
        if not error and self._fires("corrupt-bytes", f) and k == 0:
            d = descs[0]
            span = self.decode.buf[d.dst_offset: d.dst_offset + min(d.length, 16)]
            span ^= 0x5A
            self._event("corrupt-bytes", f, f"{span.numel()} bytes flipped at {self.decode.where(d.dst_offset)}")
        ledger.settle()
        if not error and not f.silent and not self._wait_notified(t.op, tag):
            error = "no notification within the deadline"
        if error:
            self.stats["failed"] += 1
            f.chunks.append(ChunkNotice(k, False, src_digest, "", error))
            self._recover()
            return TransferNotice(t.id, False, tuple(f.chunks), error, self.name)
        self.stats["chunks"] += 1
        self.stats["bytes"] += sum(d.length for d in descs)
        dst_digest = digest(self.decode, [(d.dst_offset, d.length) for d in intended])
        f.chunks.append(ChunkNotice(k, True, src_digest, dst_digest))
        f.next_chunk += 1
        if f.next_chunk < len(t.chunks):
            return None
        return TransferNotice(t.id, True, tuple(f.chunks), "", self.name)

    def _wait_notified(self, op: str, tag: bytes) -> bool:
        if op == "READ":
            return True  # the decode side initiated: its own completion status is the news
        stop = time.monotonic() + NOTIFY_DEADLINE_S
        while True:
            if self._notified(tag):
                return True
            if time.monotonic() > stop:
                return False
            time.sleep(0.0005)

    def _recover(self) -> None:
        """After a failed handle: make the next transfer possible (a new peer, ...)."""
