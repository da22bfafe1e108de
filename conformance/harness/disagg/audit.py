"""Read audits for a worker step: which bytes a step reads were not written
for that request's tokens (nor are a zeroed tail).  The memory's provenance
answers; what the implementation says is never consulted.  Each function
returns the first such byte in words, or None; the worker runner reports
them with the step and :mod:`conformance.judge.disagg.reads` judges them."""

from __future__ import annotations

import torch

from .provenance import ZERO
from .worker_memory import WorkerMemory


def _first_bad(ids: torch.Tensor, ok) -> int | None:
    for v in torch.unique(ids).tolist():
        if not ok(v):
            return v
    return None


def audit_kv(mem: WorkerMemory, table: tuple[int, ...], seq: tuple[int, ...], n: int) -> str | None:
    """KV positions [0, n): each byte must hold the KV of ``seq[:pos+1]`` (from
    whichever request computed that prefix: prefix hits are legitimate)."""
    B = mem.geometry.block_size
    for bi in range(-(-n // B)):
        prov = mem._kv_prov(table[bi])
        for off in range(min(B, n - bi * B)):
            pos = bi * B + off
            want = seq[: pos + 1]
            bad = _first_bad(prov[:, off, :], lambda v, want=want: (lab := mem.labels.get(v)) is not None
                             and lab.kind == "kv" and lab.tokens == want)
            if bad is not None:
                return (f"KV position {pos} in {mem.where(mem.geometry.kv_offset(table[bi], 0, 0, off))} "
                        f"holds {mem.labels.describe(bad, want)}")
    return None


def audit_state(mem: WorkerMemory, slot: int, prefix: tuple[int, ...]) -> str | None:
    for off, length in mem.state_ranges(slot):
        ids = mem.prov[off: off + length]
        bad = _first_bad(ids, lambda v: (lab := mem.labels.get(v)) is not None
                         and lab.kind == "state" and lab.tokens == prefix)
        if bad is not None:
            at = off + int((ids == bad).nonzero()[0, 0])
            return (f"{mem.where(at)} holds {mem.labels.describe(bad, prefix)} "
                    f"(wanted the state after {len(prefix)} tokens)")
    return None


def audit_tail(mem: WorkerMemory, page: int, first: int, request_id: str) -> str | None:
    """The part of the last block a tile kernel reads past the computed tokens:
    zeroed, or written for this very request."""
    prov = mem._kv_prov(page)[:, first:, :]
    bad = _first_bad(prov, lambda v: v == ZERO or ((lab := mem.labels.get(v)) is not None
                                                   and lab.request_id == request_id and lab.kind == "kv"))
    if bad is None:
        return None
    idx = (prov == bad).nonzero()[0]
    pos = first + int(idx[1])
    return (f"unzeroed tail: {mem.where(mem.geometry.kv_offset(page, 0, 0, pos))} read by request "
            f"{request_id}'s tile holds {mem.labels.describe(bad)}")
