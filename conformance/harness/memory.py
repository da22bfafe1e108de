"""The physical memory the harness owns: KV blocks and recurrent state slots.

Window layers (``ModelConfig.window_groups``) keep their KV per window group,
beside the full attention layers', in pages of the same block ids: a block id
is one page of one pool shared by every group (vLLM's hybrid allocator), so
writing a position of block b for one group poisons what b held at that
offset for every other group (unless that was the same sequence's position:
a cache without window tables writes its window layers through
``block_table``, into the same block ids as the full layers, as an engine
that keeps every attention layer in one group does).

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

from conformance.contract import NULL_BLOCK, Layout
from conformance.errors import ContractError
from conformance.model import ModelConfig, RecState

Prefix = tuple[int, ...]
POISON = float("nan")


def declared_groups(groups: tuple[tuple[int, ...], ...], layer_windows: tuple[int, ...]):
    """``(window of each group, group of each W layer)`` for a cache's declared layer groups: a
    partition of the W layers (indices among them, in layer order), each group of one window."""
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(len(layer_windows))) or any(not g for g in groups):
        raise ContractError(f"Layout.window_layer_groups {groups} is not a partition of the model's "
                            f"{len(layer_windows)} window layers (indices 0..{len(layer_windows) - 1})")
    windows = []
    for g in groups:
        seen = {layer_windows[i] for i in g}
        if len(seen) != 1:
            raise ContractError(f"Layout.window_layer_groups: group {g} mixes windows {sorted(seen)}")
        windows.append(seen.pop())
    of_layer = {i: n for n, g in enumerate(groups) for i in g}
    return tuple(windows), tuple(of_layer[i] for i in range(len(layer_windows)))


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
        # Window groups: per group g (window windows[g]), its layers' KV, provenance and origin per
        # block.  ``layer_groups``: the group of each W layer, in layer order (by default one group
        # per distinct window, ModelConfig.window_groups; a finer grouping gives each group its table).
        self.windows: tuple[int, ...] = c.window_groups
        self.layer_groups: tuple[int, ...] = tuple(self.windows.index(w) for w in c.layer_windows if w)
        if layout.window_layer_groups:  # the cache's own layer groups (Layout.window_layer_groups)
            self.windows, self.layer_groups = declared_groups(layout.window_layer_groups,
                                                              tuple(w for w in c.layer_windows if w))
        self.win = [poisoned(self.layer_groups.count(g), layout.num_kv_blocks, B, 2, c.attn_heads, c.head_dim)
                    for g in range(len(self.windows))]
        self.win_prov: list[list[list[Prefix | None]]] = [[[None] * B for _ in range(layout.num_kv_blocks)]
                                                          for _ in self.windows]
        self.win_origin: list[list[int | None]] = [[None] * layout.num_kv_blocks for _ in self.windows]

    # -- validation ----------------------------------------------------------------
    def check_block(self, block: int) -> None:
        if not 0 <= block < self.layout.num_kv_blocks:
            raise ContractError(f"KV block {block} outside [0, {self.layout.num_kv_blocks})")

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.num_state_slots:
            raise ContractError(f"state slot {slot} outside [0, {self.layout.num_state_slots})")

    # -- KV ------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """The page: what it holds for every group (one group's, on a correct cache)."""
        self.check_block(src)
        self.check_block(dst)
        self.kv[:, dst] = self.kv[:, src]
        self.kv_prov[dst] = list(self.kv_prov[src])
        self.kv_origin[dst] = self.kv_origin[src]
        for g in range(len(self.windows)):
            self.win[g][:, dst] = self.win[g][:, src]
            self.win_prov[g][dst] = list(self.win_prov[g][src])
            self.win_origin[g][dst] = self.win_origin[g][src]

    # -- the page shared by the groups ------------------------------------------------
    def prov_rows(self, group: int | None) -> list[list[Prefix | None]]:
        """Per block, per offset: the prefix whose KV ``group`` holds there (None: the full layers)."""
        return self.kv_prov if group is None else self.win_prov[group]

    def clobber(self, group: int | None, block: int, off: int, n: int, tokens: Prefix, start: int) -> None:
        """A write of ``group`` at ``block`` offsets [off, off + n) (positions from
        ``start``, of ``tokens``): the page's other groups lose those offsets,
        unless they held the same positions of the same sequence."""
        if not self.windows:
            return
        for other in (None, *range(len(self.windows))):
            if other == group:
                continue
            row = self.prov_rows(other)[block]
            for i in range(n):
                held = row[off + i]
                if held is not None and held != tokens[: start + i + 1]:
                    row[off + i] = None
                    store = self.kv if other is None else self.win[other]
                    store[:, block, off + i] = POISON

    def read_kv(self, block_table: tuple[int, ...], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of positions [0, n) per attention layer, gathered through the table."""
        B = self.layout.block_size
        need = -(-n // B)
        if len(block_table) < need:
            raise ContractError(f"block table has {len(block_table)} blocks, {need} needed for {n} tokens")
        for b in block_table[:need]:
            self.check_block(b)
        idx = torch.tensor(block_table[:need], dtype=torch.long)
        # (index_select and unbind: the same gather and views as kv[:, idx] and
        # g[i, :, 0], without the cost of Python indexing on every step)
        g = self.kv.index_select(1, idx).view(self.kv.shape[0], need * B, *self.kv.shape[3:])[:, :n]
        return [(k, v) for k, v in (layer.unbind(1) for layer in g.unbind(0))]

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
            self.clobber(None, b, off, n, tokens, pos)
            for p in range(pos, pos + n):
                self.kv_prov[b][p % B] = tokens[: p + 1]
            if off == 0:  # a block computed from its start holds no loaded bytes
                self.kv_origin[b] = None
            pos += n

    # -- window groups -------------------------------------------------------------
    def window_reads(self, group: int, start: int) -> int:
        """The first position a step starting at ``start`` reads in ``group``."""
        return max(0, start - self.windows[group] + 1)

    def _window_blocks(self, group: int, table: tuple[int, ...], first: int, end: int, what: str) -> None:
        B = self.layout.block_size
        if end > first and len(table) < -(-end // B):
            raise ContractError(f"window group {group}'s block table has {len(table)} blocks, {-(-end // B)} "
                                f"needed to {what} up to position {end}")
        for i in range(first // B, -(-end // B)):
            if table[i] == NULL_BLOCK:
                raise ContractError(f"window group {group} (window {self.windows[group]}): the step {what}s "
                                    f"position {max(first, i * B)} through block index {i}, which the table leaves "
                                    f"null")
            self.check_block(table[i])

    def read_window(self, group: int, table: tuple[int, ...], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of the positions a step starting at ``start`` reads in ``group``
        ([start - W + 1, start), from 0 at least), per layer of the group."""
        B = self.layout.block_size
        first = self.window_reads(group, start)
        self._window_blocks(group, table, first, start, "read")
        store = self.win[group]
        if start == first:
            empty = store.new_zeros(0, *store.shape[3:])
            return [(empty[:, 0], empty[:, 1]) for _ in range(store.shape[0])]
        lo, hi = first // B, -(-start // B)
        idx = torch.tensor(table[lo:hi], dtype=torch.long)
        g = store[:, idx].reshape(store.shape[0], (hi - lo) * B, *store.shape[3:])[:, first - lo * B:start - lo * B]
        return [(g[i, :, 0], g[i, :, 1]) for i in range(g.shape[0])]

    def write_window(self, group: int, table: tuple[int, ...], start: int, new_kv, tokens: Prefix) -> None:
        B = self.layout.block_size
        end = start + new_kv[0][0].shape[0]
        self._window_blocks(group, table, start, end, "write")
        kv = torch.stack([torch.stack((k, v), dim=1) for k, v in new_kv])
        store, prov = self.win[group], self.win_prov[group]
        pos = start
        while pos < end:
            b, off = table[pos // B], pos % B
            n = min(B - off, end - pos)
            store[:, b, off:off + n] = kv[:, pos - start:pos - start + n]
            self.clobber(group, b, off, n, tokens, pos)
            for p in range(pos, pos + n):
                prov[b][p % B] = tokens[: p + 1]
            if off == 0:
                self.win_origin[group][b] = None
            pos += n

    def mark_window(self, group: int, table: tuple[int, ...], start: int, end: int, tokens: Prefix) -> None:
        """Provenance of a window write without the bytes (see :meth:`mark_kv`)."""
        B = self.layout.block_size
        self._window_blocks(group, table, self.window_reads(group, start), end, "write")
        for pos in range(start, end):
            b, off = table[pos // B], pos % B
            self.clobber(group, b, off, 1, tokens, pos)
            self.win_prov[group][b][off] = tokens[: pos + 1]
            if off == 0:
                self.win_origin[group][b] = None

    def window_misreads(self, group: int, table: tuple[int, ...], tokens: Prefix, start: int) -> list[str]:
        """What a step starting at ``start`` reads in ``group`` that memory does
        not hold for ``tokens`` (by provenance), as sentences (empty: all held)."""
        B, prov = self.layout.block_size, self.win_prov[group]
        for pos in range(self.window_reads(group, start), start):
            b = table[pos // B] if pos // B < len(table) else NULL_BLOCK
            if not 0 <= b < self.layout.num_kv_blocks:
                return [f"window group {group} (window {self.windows[group]}) reads position {pos} through "
                        f"block index {pos // B}, which names no block ({b})"]
            held = prov[b][pos % B]
            if held != tokens[: pos + 1]:
                what = "never-written or overwritten memory (poison)" if held is None else (
                    f"position {len(held) - 1} of this sequence" if tokens[: len(held)] == held
                    else f"position {len(held) - 1} of another sequence")
                return [f"window group {group} (window {self.windows[group]}) reads position {pos} from block {b}, "
                        f"which holds {what}"]
        return []

    def mark_kv(self, block_table: tuple[int, ...], start: int, end: int, tokens: Prefix) -> None:
        """Provenance of a write without the bytes (the pool probe measures
        capacity, not logits: its steps are not computed, and it ends the session)."""
        B = self.layout.block_size
        if len(block_table) < -(-end // B):
            raise ContractError(f"block table has {len(block_table)} blocks, {-(-end // B)} needed for {end} tokens")
        for pos in range(start, end):
            b, off = block_table[pos // B], pos % B
            self.check_block(b)
            self.clobber(None, b, off, 1, tokens, pos)
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
        """The slot's state per recurrent layer, as views of memory (no copies:
        the model only reads them, and a step reads every state before it
        writes any; a clone per layer and part was about 1% of a quick profile).
        Read them before memory changes, or clone them."""
        self.check_slot(slot)
        return [RecState(conv=c, ssm=s) for c, s in zip(self.conv[:, slot].unbind(0), self.ssm[:, slot].unbind(0))]

    def write_state(self, slot: int, states: list[RecState], prefix: Prefix) -> None:
        self.check_slot(slot)
        if states:  # every layer's part in one copy (the same bytes as one copy per layer, in fewer operations)
            self.conv[:, slot] = torch.stack([s.conv for s in states])
            self.ssm[:, slot] = torch.stack([s.ssm for s in states])
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

    def loads_read(self, block_table: tuple[int, ...], n: int, slot: int,
                   window_tables: tuple[tuple[int, ...], ...] = ()) -> frozenset[int]:
        """Ids of the loads whose bytes a step reading KV [0, n) and ``slot`` reads
        (and, through ``window_tables``, what its window layers read)."""
        B = self.layout.block_size
        ids = {self.kv_origin[b] for b in block_table[: -(-n // B)]} | {self.state_origin[slot]} if n else set()
        for g, table in enumerate(window_tables if n else ()):
            ids |= {self.win_origin[g][b] for b in table[self.window_reads(g, n) // B: -(-n // B)]
                    if 0 <= b < self.layout.num_kv_blocks}
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
