"""The in-process copy transport: the same interface, contracts and failure
shapes as the NIXL transport, for machines without NIXL.  It enforces what
NIXL enforces (every range inside a registered buffer; a dead peer fails the
next post with a disconnect error) and copies bytes with torch."""

from __future__ import annotations

from conformance.disagg.contract import Descriptor

from .transport import TransferError, Transport


class InProcessTransport(Transport):
    name = "in-process copy"

    def _connect(self) -> None:
        self._peer_alive = True
        self._notifs: set[bytes] = set()

    def _post(self, op: str, descriptors: tuple[Descriptor, ...], tag: bytes) -> None:
        if not self._peer_alive:
            raise TransferError("RemoteDisconnect", "remote agent 'decode' was disconnected (peer killed)")
        src, dst = self.prefill, self.decode
        for d in descriptors:
            if (d.length <= 0 or d.src_offset < 0 or d.src_offset + d.length > src.geometry.buffer_bytes
                    or d.dst_offset < 0 or d.dst_offset + d.length > dst.geometry.buffer_bytes):
                raise TransferError("NotFound", f"no registration covers descriptor {d}")
        for d in descriptors:
            dst.buf[d.dst_offset: d.dst_offset + d.length] = src.buf[d.src_offset: d.src_offset + d.length]
        if tag:
            self._notifs.add(tag)

    def _notified(self, tag: bytes) -> bool:
        if tag in self._notifs:
            self._notifs.discard(tag)
            return True
        return False

    def _kill_peer(self) -> str:
        self._peer_alive = False
        return "in-process peer marked dead"

    def _recover(self) -> None:
        self._peer_alive = True
