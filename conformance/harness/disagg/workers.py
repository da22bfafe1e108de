"""Builds the two workers (memories, shared labels) and the transport
between them, and picks the transport: real NIXL when it imports, else the
in-process copy transport -- always saying which ran."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from itertools import count

from conformance.disagg.contract import DisaggLayouts, Handshake
from conformance.disagg.geometry import WorkerGeometry
from conformance.model import ModelConfig

from .faults import FaultSpec
from .inprocess import InProcessTransport
from .nixl_transport import NixlTransport, nixl_available
from .provenance import Labels
from .transport import Transport
from .worker_memory import WorkerMemory

TRANSPORTS = ("auto", "nixl", "inprocess")
_serial = count()


def make_transport(kind: str = "auto", faults: tuple[FaultSpec, ...] = ()) -> tuple[Transport, str]:
    """(transport, why this one).  ``nixl`` insists (ValueError when it cannot run)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; known: {', '.join(TRANSPORTS)}")
    why_not = nixl_available() if kind != "inprocess" else "in-process transport requested"
    if kind == "nixl" and why_not:
        raise ValueError(why_not)
    if why_not:
        return InProcessTransport(faults), why_not
    return NixlTransport(faults), "nixl imports"


@dataclass
class Workers:
    prefill: WorkerMemory
    decode: WorkerMemory
    transport: Transport
    handshake: Handshake

    def of(self, worker: str) -> WorkerMemory:
        return self.prefill if worker == "prefill" else self.decode

    def reset(self) -> None:
        """Ready for a new, independent scenario: memory back to fresh poison, the
        transport's flights and armed faults forgotten (its processes stay up)."""
        self.prefill.poison()
        self.decode.poison()
        self.transport.reset()

    def close(self) -> None:
        self.transport.close()
        self.prefill.close()
        self.decode.close()


class WorkerPool:
    """Workers built once per pair of layouts and handed out reset, so a check
    (or a state machine's run) starts the NIXL peer process once per layout
    pairing, not once per example or per replay of a minimization (a peer
    takes about a second to start).  Reset memory is what fresh memory is
    (poison), so a scenario run on pooled workers replays the same on fresh
    ones (``replay``)."""

    def __init__(self, model: ModelConfig, kind: str = "auto"):
        self.model = model
        self.kind = kind
        self._workers: dict[DisaggLayouts, tuple[Workers, str]] = {}
        self.built = 0  # pairs of workers (and transports) built: one per layout pair
        self.transports: list[tuple[str, str]] = []  # (name, why this one) of each transport built
        self.peer_starts = 0  # NIXL peer processes started (a killed peer is replaced), once closed


    def get(self, layouts: DisaggLayouts) -> tuple[Workers, str]:
        """(reset workers for ``layouts``, why this transport)."""
        found = self._workers.get(layouts)
        if found is None:
            transport, why = make_transport(self.kind)
            found = self._workers[layouts] = (build_workers(layouts, self.model, transport), why)
            self.built += 1
            self.transports.append((transport.name, why))
        else:
            found[0].reset()
        return found

    def close(self) -> None:
        for workers, _ in self._workers.values():
            self.peer_starts += getattr(workers.transport, "spawns", 0)
            workers.close()
        self._workers.clear()


def _shm_path() -> str:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"hcc-disagg-{os.getpid()}-{next(_serial)}.buf")


def build_workers(layouts: DisaggLayouts, model: ModelConfig, transport: Transport) -> Workers:
    prefill_layout = layouts.prefill
    if any(f.kind == "dtype-mismatch" for f in transport.faults):
        # The prefill side really keeps its state in float32; the metadata says so.
        prefill_layout = replace(prefill_layout, state_dtype="float32" if layouts.decode.state_dtype == "float64"
                                 else "float64")
    labels = Labels()
    prefill = WorkerMemory(WorkerGeometry.of(prefill_layout, model), labels)
    shared = _shm_path() if getattr(transport, "needs_shared_decode", False) else None
    decode = WorkerMemory(WorkerGeometry.of(layouts.decode, model), labels, shared_path=shared)
    try:
        handshake = transport.open(prefill, decode)
    except BaseException:
        decode.close()
        raise
    return Workers(prefill, decode, transport, handshake)
