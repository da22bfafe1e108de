"""The physical memory the harness owns: KV blocks and recurrent state slots.

Like device memory it starts as garbage (NaN poison) and keeps its old bytes
when an implementation frees something, so reading unwritten or stale data
shows up in the logits.  Beside the bytes it keeps *provenance*: for every KV
position and every state slot, the token prefix whose computation produced
what is stored there.  Provenance never influences execution; it lets the
checker explain a wrong logit ("slot 3 holds the state after 13 tokens, the
step needed the state after 12") and check the implementation's bookkeeping
against what memory really holds.
"""

from __future__ import annotations

import torch

from conformance.contract import Layout
from conformance.errors import ContractError
from conformance.model import ModelConfig, RecState

Prefix = tuple[int, ...]
POISON = float("nan")


class Memory:
    def __init__(self, layout: Layout, model: ModelConfig, dtype: torch.dtype = torch.float64,
                 device: str = "cpu"):
        self.layout = layout
        c, B = model, layout.block_size
        def poisoned(*shape: int) -> torch.Tensor:
            return torch.full(shape, POISON, dtype=dtype, device=device)

        self.kv = poisoned(c.num_attn_layers, layout.num_kv_blocks, B, 2, c.attn_heads, c.head_dim)
        self.conv = poisoned(c.num_rec_layers, layout.num_state_slots, c.conv_width - 1, c.conv_channels)
        self.ssm = poisoned(c.num_rec_layers, layout.num_state_slots, c.rec_heads, c.rec_value_dim, c.rec_key_dim)
        # kv_prov[block][offset] = the prefix ending at that position (None = never written)
        self.kv_prov: list[list[Prefix | None]] = [[None] * B for _ in range(layout.num_kv_blocks)]
        # conv_prov / ssm_prov[slot] = the prefix whose state that part holds
        self.conv_prov: list[Prefix | None] = [None] * layout.num_state_slots
        self.ssm_prov: list[Prefix | None] = [None] * layout.num_state_slots
        # Where the current bytes came from: the id of the load that landed them
        # (copies carry it along), or None (computed, zeroed, never written).  How
        # coverage tells a hit served by the second tier from any hit, and a fault's
        # corrupted load that a step read from one that was never used.
        self.kv_origin: list[int | None] = [None] * layout.num_kv_blocks
        self.state_origin: list[int | None] = [None] * layout.num_state_slots

    # -- validation ----------------------------------------------------------------
    def check_block(self, block: int) -> None:
        if not 0 <= block < self.layout.num_kv_blocks:
            raise ContractError(f"KV block {block} outside [0, {self.layout.num_kv_blocks})")

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.num_state_slots:
            raise ContractError(f"state slot {slot} outside [0, {self.layout.num_state_slots})")

    # -- KV ------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        self.check_block(src)
        self.check_block(dst)
        self.kv[:, dst] = self.kv[:, src]
        self.kv_prov[dst] = list(self.kv_prov[src])
        self.kv_origin[dst] = self.kv_origin[src]

    def read_kv(self, block_table: tuple[int, ...], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of positions [0, n) per attention layer, gathered through the table."""
        B = self.layout.block_size
        need = -(-n // B)
        if len(block_table) < need:
            raise ContractError(f"block table has {len(block_table)} blocks, {need} needed for {n} tokens")
        for b in block_table[:need]:
            self.check_block(b)
        idx = torch.tensor(block_table[:need], dtype=torch.long)
        g = self.kv[:, idx].reshape(self.kv.shape[0], need * B, *self.kv.shape[3:])[:, :n]
        return [(g[i, :, 0], g[i, :, 1]) for i in range(g.shape[0])]

    def write_kv(self, block_table: tuple[int, ...], start: int, new_kv, tokens: Prefix) -> None:
        B = self.layout.block_size
        end = start + new_kv[0][0].shape[0]
        if len(block_table) < -(-end // B):
            raise ContractError(f"block table has {len(block_table)} blocks, {-(-end // B)} needed for {end} tokens")
        for i in range(start // B, -(-end // B)):
            self.check_block(block_table[i])
        if end == start:
            return
        # (layers, positions, K|V, heads, dim), written one block's run at a time
        kv = torch.stack([torch.stack((k, v), dim=1) for k, v in new_kv])
        pos = start
        while pos < end:
            b, off = block_table[pos // B], pos % B
            n = min(B - off, end - pos)
            self.kv[:, b, off:off + n] = kv[:, pos - start:pos - start + n]
            for p in range(pos, pos + n):
                self.kv_prov[b][p % B] = tokens[: p + 1]
            if off == 0:  # a block computed from its start holds no loaded bytes
                self.kv_origin[b] = None
            pos += n

    def mark_kv(self, block_table: tuple[int, ...], start: int, end: int, tokens: Prefix) -> None:
        """Provenance of a write without the bytes (the pool probe measures
        capacity, not logits: its steps are not computed, and it ends the session)."""
        B = self.layout.block_size
        if len(block_table) < -(-end // B):
            raise ContractError(f"block table has {len(block_table)} blocks, {-(-end // B)} needed for {end} tokens")
        for pos in range(start, end):
            b, off = block_table[pos // B], pos % B
            self.check_block(b)
            self.kv_prov[b][off] = tokens[: pos + 1]
            if off == 0:
                self.kv_origin[b] = None

    def mark_state(self, slot: int, prefix: Prefix) -> None:
        """Provenance of a state write without the bytes (see :meth:`mark_kv`)."""
        self.check_slot(slot)
        self.conv_prov[slot] = self.ssm_prov[slot] = prefix
        self.state_origin[slot] = None

    # -- recurrent states ----------------------------------------------------------
    def read_state(self, slot: int) -> list[RecState]:
        self.check_slot(slot)
        return [RecState(conv=self.conv[i, slot].clone(), ssm=self.ssm[i, slot].clone())
                for i in range(self.conv.shape[0])]

    def write_state(self, slot: int, states: list[RecState], prefix: Prefix) -> None:
        self.check_slot(slot)
        for i, s in enumerate(states):
            self.conv[i, slot] = s.conv
            self.ssm[i, slot] = s.ssm
        self.conv_prov[slot] = self.ssm_prov[slot] = prefix
        self.state_origin[slot] = None

    def zero_state(self, slot: int) -> None:
        self.check_slot(slot)
        self.conv[:, slot] = 0
        self.ssm[:, slot] = 0
        self.conv_prov[slot] = self.ssm_prov[slot] = ()
        self.state_origin[slot] = None

    def copy_state(self, src: int, dst: int, conv: bool = True, ssm: bool = True) -> None:
        self.check_slot(src)
        self.check_slot(dst)
        if conv:
            self.conv[:, dst] = self.conv[:, src]
            self.conv_prov[dst] = self.conv_prov[src]
        if ssm:
            self.ssm[:, dst] = self.ssm[:, src]
            self.ssm_prov[dst] = self.ssm_prov[src]
        if conv or ssm:
            self.state_origin[dst] = self.state_origin[src]

    # -- provenance queries (for the checker's explanations) -------------------------
    def kv_holds(self, block_table: tuple[int, ...], tokens: Prefix, start: int, end: int) -> int | None:
        """First position in [start, end) whose stored KV is not that of ``tokens``."""
        B = self.layout.block_size
        for pos in range(start, end):
            b = block_table[pos // B] if pos // B < len(block_table) else None
            if b is None or not 0 <= b < self.layout.num_kv_blocks or self.kv_prov[b][pos % B] != tokens[: pos + 1]:
                return pos
        return None

    def loads_read(self, block_table: tuple[int, ...], n: int, slot: int) -> frozenset[int]:
        """Ids of the loads whose bytes a step reading KV [0, n) and ``slot`` reads."""
        B = self.layout.block_size
        ids = {self.kv_origin[b] for b in block_table[: -(-n // B)]} | {self.state_origin[slot]} if n else set()
        ids.discard(None)
        return frozenset(i for i in ids if i is not None)

    def state_holds(self, slot: int) -> tuple[Prefix | None, Prefix | None]:
        return self.conv_prov[slot], self.ssm_prov[slot]

    def state_prefix_held(self, prompt: Prefix) -> int:
        """The longest proper prefix of ``prompt`` whose whole state (conv and
        matrix) some slot holds, by provenance."""
        held = 0
        for slot in range(self.layout.num_state_slots):
            conv, ssm = self.state_holds(slot)
            if conv is not None and conv == ssm and held < len(conv) < len(prompt) and prompt[:len(conv)] == conv:
                held = len(conv)
        return held
