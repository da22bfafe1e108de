"""Draft contract extension: a prefill and a decode worker, and the transfers
between them (plain frozen dataclasses, as in :mod:`conformance.contract`).

Backward compatible by construction: nothing here changes a type an adapter
written today uses.  A disaggregated implementation additionally provides

    disagg_layouts() -> DisaggLayouts          the two workers it wants allocated
    connect(Handshake) -> None                  what the metadata exchange told it
    schedule(budget) -> DisaggPlan              worker-tagged steps (RequestStep.worker),
                                                transfers, tail zeroing
    update(plan, DisaggResult) -> list[str]     sampled tokens and transfer notices

Positions are token indices; offsets and lengths in descriptors are **bytes**
inside one worker's registered buffer, as NIXL takes them: a descriptor list
pairs source and destination ranges element-wise, each pair of equal length
(NIXL 1.5.1 rejects anything else, see ``nixl-1.5.1-notes.md`` section 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from conformance.contract import RequestStep
from conformance.disagg.geometry import WorkerGeometry

# The layouts live in .layout (geometry builds on them, and this module on
# geometry); they are part of this contract too, so they are importable here.
from conformance.disagg.layout import (  # noqa: F401
    DECODE,
    PREFILL,
    STATE_DTYPES,
    WORKERS,
    DisaggLayouts,
    WorkerLayout,
)


@dataclass(frozen=True)
class Descriptor:
    """One (source range, destination range) pair: bytes
    ``[src_offset, src_offset + length)`` of the prefill buffer and
    ``[dst_offset, dst_offset + length)`` of the decode buffer."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class DisaggTransfer:
    """Prefill -> decode bytes for one request.

    Each chunk becomes one transfer handle (NIXL completes per handle, never
    per descriptor); the transport posts one chunk per engine step, so a
    transfer of k chunks is in flight for k steps.  ``op``: ``READ`` -- the
    decode side pulls (vLLM's NIXL connector); ``WRITE`` -- the prefill side
    pushes and the decode side learns of completion by notification (SGLang,
    Mooncake)."""

    id: int  # unique per implementation; notices are matched by it, never by order
    request_id: str
    chunks: tuple[tuple[Descriptor, ...], ...]
    op: Literal["READ", "WRITE"] = "WRITE"

    def __post_init__(self) -> None:
        if self.op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, got {self.op!r}")
        if not self.chunks or any(not c for c in self.chunks):
            raise ValueError(f"transfer {self.id}: every chunk needs at least one descriptor")

    @property
    def nbytes(self) -> int:
        return sum(d.length for c in self.chunks for d in c)


@dataclass(frozen=True)
class ZeroRegion:
    """Bytes a worker zeroes itself (untransferred tails), before any step computes."""

    worker: str
    offset: int
    length: int


@dataclass(frozen=True)
class ChunkNotice:
    index: int
    ok: bool  # the transport completed the handle (says nothing about the bytes)
    src_digest: str = ""  # the sender's digest of the chunk's source ranges, at post time
    dst_digest: str = ""  # the receiver's digest of the chunk's destination ranges, on completion
    error: str = ""


@dataclass(frozen=True)
class TransferNotice:
    """What the decode side learns about a transfer: once, when every chunk
    completed or the first one failed.  A correct receiver trusts the bytes
    only when ``ok`` and every chunk's digests agree."""

    id: int
    ok: bool
    chunks: tuple[ChunkNotice, ...] = ()
    error: str = ""
    transport: str = ""  # which transport ran ("nixl-ucx ...", "in-process copy")


@dataclass(frozen=True)
class DisaggPlan:
    """One engine step over both workers.  Order: transport progress (posts
    chunks, delivers notices into the *next* result), zeroing, then copies and
    computation of ``requests`` (each tagged with ``RequestStep.worker``)."""

    requests: tuple[RequestStep, ...] = ()
    transfers: tuple[DisaggTransfer, ...] = ()  # submitted this step
    zero: tuple[ZeroRegion, ...] = ()


@dataclass(frozen=True)
class DisaggResult:
    sampled: dict[str, int] = field(default_factory=dict)
    notices: tuple[TransferNotice, ...] = ()


@dataclass(frozen=True)
class Handshake:
    """The result of the metadata exchange: each worker's geometry (byte
    offsets of every view, see :mod:`.geometry`) and which transport carries
    the bytes.  A receiver must compare what it is told (dtype, shard counts)
    with its own layout before trusting a single byte."""

    prefill: WorkerGeometry
    decode: WorkerGeometry
    transport: str
