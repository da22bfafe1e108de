"""One worker's physical memory: a byte buffer of pages, typed views into
it laid out by :mod:`.geometry`, and byte-level provenance.

Like :class:`conformance.memory.Memory` it starts as NaN poison and is never
cleared by the harness: pages are reused across requests and keep their old
bytes, so an untransferred or unzeroed region holds someone else's data.  It
offers the same read/write surface as ``Memory`` (KV through a block table,
states by slot) so the model runs on it unchanged; block ids and slot ids are
both page ids.

The buffer may live in a shared-memory file so that a second process (the
NIXL peer agent) registers the very same bytes.
"""

from __future__ import annotations

import os

import torch

from conformance.disagg.geometry import KV_ITEM, PARTS, WorkerGeometry
from conformance.errors import ContractError
from conformance.model import RecState

from .provenance import POISON, ZERO, Label, Labels

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def allocate_buffer(nbytes: int, shared_path: str | None = None) -> torch.Tensor:
    """A uint8 buffer; in a shared-memory file when ``shared_path`` is given."""
    if shared_path is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    with open(shared_path, "wb") as fh:
        fh.truncate(nbytes)
    return torch.from_file(shared_path, shared=True, size=nbytes, dtype=torch.uint8)


class WorkerMemory:
    def __init__(self, geometry: WorkerGeometry, labels: Labels, buffer: torch.Tensor | None = None,
                 shared_path: str | None = None):
        g = self.geometry = geometry
        self.name = g.layout.worker
        self.labels = labels
        self.shared_path = shared_path
        self.buf = buffer if buffer is not None else allocate_buffer(g.buffer_bytes, shared_path)
        if self.buf.numel() != g.buffer_bytes or self.buf.dtype != torch.uint8:
            raise ValueError(f"{self.name}: buffer must be {g.buffer_bytes} uint8 bytes")
        self.prov = torch.empty((g.buffer_bytes,), dtype=torch.int32)
        self.poison()
        self.state_dtype = DTYPES[g.layout.state_dtype]
        self._conv_idx, self._ssm_idx = self._state_index()

    def poison(self) -> None:
        """Back to the state of a fresh allocation: NaN bytes, labelled never written.
        A worker reused for a new, independent scenario (a state machine's next
        example) starts from what a fresh one would hold, so the scenario replays
        the same on fresh workers."""
        self.buf.view(torch.float64).fill_(float("nan"))
        self.prov.fill_(POISON)

    def close(self) -> None:
        if self.shared_path and os.path.exists(self.shared_path):
            os.unlink(self.shared_path)

    # -- layout helpers ------------------------------------------------------------
    def check_page(self, page: int) -> None:
        if not 0 <= page < self.geometry.layout.num_pages:
            raise ContractError(f"{self.name} page {page} outside [0, {self.geometry.layout.num_pages})")

    check_block = check_slot = check_page

    def _state_index(self):
        """Per recurrent layer, the element index (in state-dtype items from the
        page start) of every element of the model's conv state [rows, channels]
        and matrix state [heads, value, key]."""
        g = self.geometry
        it = g.state_item
        per_head = 2 * g.key_dim + g.value_dim
        part_at = {"q": 0, "k": g.key_dim, "v": 2 * g.key_dim}
        conv, ssm = [], []
        for layer in range(g.rec_layers):
            ci = torch.empty(g.conv_rows, g.rec_heads * per_head, dtype=torch.long)
            si = torch.empty(g.rec_heads, g.value_dim, g.key_dim, dtype=torch.long)
            for h in range(g.rec_heads):
                shard, local = g.shard_of(h)
                for part in PARTS:
                    base = g.conv_part_offset(0, shard, layer, part, local) // it
                    dim = g.part_dim(part)
                    # DS layout: [dim][time] inside the part
                    block = base + torch.arange(dim)[None, :] * g.conv_rows + torch.arange(g.conv_rows)[:, None]
                    c0 = h * per_head + part_at[part]
                    ci[:, c0: c0 + dim] = block
                base = g.ssm_offset(0, shard, layer, local) // it
                si[h] = base + torch.arange(g.value_dim * g.key_dim).view(g.value_dim, g.key_dim)
            conv.append(ci.flatten())
            ssm.append(si.flatten())
        return conv, ssm

    def _state_items(self, page: int) -> torch.Tensor:
        g = self.geometry
        off = g.page_offset(page)
        return self.buf[off: off + g.state_view_bytes].view(self.state_dtype)

    def _kv(self, page: int) -> torch.Tensor:
        g = self.geometry
        off = g.page_offset(page)
        return self.buf[off: off + g.kv_view_bytes].view(torch.float64).view(
            g.attn_layers, 2, g.block_size, g.attn_heads, g.head_dim)

    def _kv_prov(self, page: int) -> torch.Tensor:
        g = self.geometry
        off = g.page_offset(page)
        return self.prov[off: off + g.kv_view_bytes].view(g.attn_layers * 2, g.block_size, g.kv_row_bytes)

    def _state_prov(self, page: int) -> torch.Tensor:
        off = self.geometry.page_offset(page)
        return self.prov[off: off + self.geometry.state_view_bytes]

    def state_ranges(self, page: int, parts=("conv", "ssm")) -> list[tuple[int, int]]:
        """Byte ranges (offset, length) of a slot's conv and/or matrix state."""
        g = self.geometry
        out = []
        for shard in range(g.shards):
            for layer in range(g.rec_layers):
                if "conv" in parts:
                    out.append((g.conv_part_offset(page, shard, layer, "q"), g.conv_shard_bytes))
                if "ssm" in parts:
                    out.append((g.ssm_offset(page, shard, layer), g.ssm_shard_bytes))
        return out

    # -- KV ------------------------------------------------------------------------
    def read_kv(self, block_table: tuple[int, ...], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        B = self.geometry.block_size
        need = -(-n // B)
        if len(block_table) < need:
            raise ContractError(f"{self.name}: block table has {len(block_table)} blocks, {need} needed for {n} tokens")
        for b in block_table[:need]:
            self.check_page(b)
        g = self.geometry
        if need == 0:
            empty = torch.empty(0, g.attn_heads, g.head_dim, dtype=torch.float64)
            return [(empty, empty)] * g.attn_layers
        cat = torch.cat([self._kv(b) for b in block_table[:need]], dim=2)[:, :, :n]
        return [(cat[i, 0], cat[i, 1]) for i in range(g.attn_layers)]

    def write_kv(self, block_table: tuple[int, ...], start: int, new_kv, tokens: tuple[int, ...],
                 request_id: str = "") -> None:
        B = self.geometry.block_size
        end = start + new_kv[0][0].shape[0]
        if len(block_table) < -(-end // B):
            raise ContractError(f"{self.name}: block table has {len(block_table)} blocks, "
                                f"{-(-end // B)} needed for {end} tokens")
        pos = start
        while pos < end:
            bi, off = divmod(pos, B)
            b = block_table[bi]
            self.check_page(b)
            stop = min(end, (bi + 1) * B)
            kv = self._kv(b)
            for layer, (k, v) in enumerate(new_kv):
                kv[layer, 0, off: off + stop - pos] = k[pos - start: stop - start]
                kv[layer, 1, off: off + stop - pos] = v[pos - start: stop - start]
            ids = torch.tensor([self.labels.id(Label("kv", request_id, tokens[: p + 1]))
                                for p in range(pos, stop)], dtype=torch.int32)
            self._kv_prov(b)[:, off: off + stop - pos, :] = ids[None, :, None]
            pos = stop

    def kv_tail(self, block_table: tuple[int, ...], end: int) -> tuple[int, int, int] | None:
        """(page, first offset, block size) of the part of the last block past ``end``:
        what a tile-based decode kernel reads beyond the tokens it attends to."""
        B = self.geometry.block_size
        if end % B == 0 or not block_table:
            return None
        return block_table[(end - 1) // B], end % B, B

    def tail_values(self, page: int, first: int) -> torch.Tensor:
        return self._kv(page)[:, 1, first:]

    # -- recurrent states ----------------------------------------------------------
    def read_state(self, slot: int) -> list[RecState]:
        self.check_page(slot)
        g = self.geometry
        items = self._state_items(slot)
        ch = self._conv_idx[0].numel() // g.conv_rows
        return [RecState(conv=items[self._conv_idx[i]].to(torch.float64).view(g.conv_rows, ch),
                         ssm=items[self._ssm_idx[i]].to(torch.float64).view(g.rec_heads, g.value_dim, g.key_dim))
                for i in range(g.rec_layers)]

    def write_state(self, slot: int, states: list[RecState], prefix: tuple[int, ...], request_id: str = "") -> None:
        self.check_page(slot)
        items = self._state_items(slot)
        for i, s in enumerate(states):
            items[self._conv_idx[i]] = s.conv.flatten().to(self.state_dtype)
            items[self._ssm_idx[i]] = s.ssm.flatten().to(self.state_dtype)
        self._state_prov(slot)[:] = self.labels.id(Label("state", request_id, tuple(prefix)))

    def zero_state(self, slot: int, request_id: str = "") -> None:
        """A fresh state: zeros, labelled as this request's state after 0 tokens."""
        self.check_page(slot)
        self._state_items(slot).zero_()
        self._state_prov(slot)[:] = self.labels.id(Label("state", request_id, ()))

    def copy_state(self, src: int, dst: int, conv: bool = True, ssm: bool = True) -> None:
        self.check_page(src)
        self.check_page(dst)
        parts = tuple(p for p, on in (("conv", conv), ("ssm", ssm)) if on)
        for (so, n), (do, _) in zip(self.state_ranges(src, parts), self.state_ranges(dst, parts)):
            self.buf[do: do + n] = self.buf[so: so + n]
            self.prov[do: do + n] = self.prov[so: so + n]

    # -- raw bytes (transfers, zeroing) ---------------------------------------------
    def check_range(self, offset: int, length: int) -> None:
        if length < 0 or offset < 0 or offset + length > self.geometry.buffer_bytes:
            raise ContractError(f"{self.name}: byte range [{offset}, {offset + length}) outside the "
                                f"{self.geometry.buffer_bytes}-byte buffer")

    def zero(self, offset: int, length: int) -> None:
        self.check_range(offset, length)
        self.buf[offset: offset + length] = 0
        self.prov[offset: offset + length] = ZERO

    # -- explanations ----------------------------------------------------------------
    def where(self, offset: int) -> str:
        """A byte offset in words, under both views its page may serve."""
        g = self.geometry
        page, rel = divmod(offset, g.page_bytes)
        kv = "padding"
        if rel < g.kv_view_bytes:
            row, pos_byte = divmod(rel, g.block_size * g.kv_row_bytes)
            layer, which = divmod(row, 2)
            kv = f"KV layer {layer} {'KV'[which]} position {pos_byte // g.kv_row_bytes}"
        st = "padding"
        if rel < g.state_view_bytes:
            shard, r = divmod(rel, g.shard_bytes)
            layer, r = divmod(r, g.layer_shard_bytes)
            if r < g.conv_shard_bytes:
                for part in PARTS:
                    if r < g.conv_part_bytes(part):
                        break
                    r -= g.conv_part_bytes(part)
                st = f"state shard {shard} layer {layer} conv part {part}"
            else:
                st = f"state shard {shard} layer {layer} matrix"
        return f"{self.name} page {page} (as a KV block: {kv}; as a state slot: {st})"


assert KV_ITEM == 8  # the KV view reads float64
