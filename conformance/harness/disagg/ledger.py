"""Provenance across a transfer, decided by the bytes.

Before a chunk is posted the ledger keeps the source bytes and labels and
the destination bytes; once the chunk completed or failed it compares: a
destination byte equal to what was sent takes the source's label, a byte
that changed into something else is labelled corrupt, a byte that did not
change keeps its old label (the stale truth).  Nothing the transport or the
implementation reports is believed, so a dropped descriptor, a truncated
tail or bytes corrupted in flight all leave exactly the provenance the
decode side will really read.
"""

from __future__ import annotations

import torch

from conformance.disagg.contract import Descriptor

from .provenance import Label
from .worker_memory import WorkerMemory


class ChunkLedger:
    def __init__(self, src: WorkerMemory, dst: WorkerMemory, descriptors: tuple[Descriptor, ...],
                 transfer_id: int, request_id: str):
        self.src, self.dst = src, dst
        self.corrupt = dst.labels.id(Label("corrupt", request_id, (), f"transfer {transfer_id}"))
        self.entries = []
        for d in descriptors:
            if not (0 <= d.src_offset and d.src_offset + d.length <= src.geometry.buffer_bytes
                    and 0 <= d.dst_offset and d.dst_offset + d.length <= dst.geometry.buffer_bytes):
                continue  # the transport rejects it; nothing moves
            s, t, n = d.src_offset, d.dst_offset, d.length
            self.entries.append((t, n, src.buf[s: s + n].clone(), src.prov[s: s + n].clone(),
                                 dst.buf[t: t + n].clone()))

    def settle(self) -> None:
        for t, n, sent, sent_prov, before in self.entries:
            after = self.dst.buf[t: t + n]
            same = after == sent
            changed = after != before
            prov = self.dst.prov[t: t + n]
            prov[same] = sent_prov[same]
            prov[changed & ~same] = self.corrupt


def digest(mem: WorkerMemory, ranges) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for off, n in ranges:
        h.update(mem.buf[off: off + n].numpy().tobytes())
    return h.hexdigest()


_ = torch  # tensors above are torch.uint8 views of the worker buffers
