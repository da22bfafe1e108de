"""Where every view lives inside a worker's pages, in bytes.

A page holds either one KV block or one recurrent state slot, laid out as
engines lay them out for transfer:

- KV view: ``[attn layer][K|V][position][head][dim]`` in float64; the
  positions of one (layer, K|V) row are contiguous, so a token range is one
  descriptor per row.
- State view: shard after shard; inside a shard, layer after layer, the conv
  state then the matrix state.  The conv state is kept per part (q, k, v --
  what Mamba calls C, B, x) in the "DS" layout ``[part][head][dim][time]``,
  so each part of each shard is one contiguous range and a heterogeneous-TP
  transfer takes one read per part (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT=DS``);
  a flat slice of a shard's conv state is wrong, the parts differ in place
  and in size.  The matrix state is ``[head][value dim][key dim]``.
- Padding: a page is as large as the larger view, rounded up to 1 KiB, so
  the smaller view leaves a gap of stale bytes behind it.

The geometry is plain data: the harness builds memory from it and hands both
workers' geometries to the implementation at the metadata exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.disagg.layout import WorkerLayout
from conformance.model import ModelConfig

PARTS = ("q", "k", "v")
KV_ITEM = 8  # KV is float64 on every worker
STATE_ITEM = {"float64": 8, "float32": 4}
PAGE_ALIGN = 1024


@dataclass(frozen=True)
class WorkerGeometry:
    layout: WorkerLayout
    attn_layers: int
    attn_heads: int
    head_dim: int
    rec_layers: int
    rec_heads: int
    key_dim: int
    value_dim: int
    conv_rows: int  # conv_width - 1: the inputs a conv state remembers

    @classmethod
    def of(cls, layout: WorkerLayout, model: ModelConfig) -> WorkerGeometry:
        if model.rec_heads % layout.state_shards:
            raise ValueError(f"{layout.worker}: {model.rec_heads} recurrent heads do not split "
                             f"into {layout.state_shards} shards")
        return cls(layout, model.num_attn_layers, model.attn_heads, model.head_dim, model.num_rec_layers,
                   model.rec_heads, model.rec_key_dim, model.rec_value_dim, model.conv_width - 1)

    # -- sizes ---------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def shards(self) -> int:
        return self.layout.state_shards

    @property
    def state_item(self) -> int:
        return STATE_ITEM[self.layout.state_dtype]

    @property
    def kv_row_bytes(self) -> int:
        """One position of K (or V) of one attention layer."""
        return self.attn_heads * self.head_dim * KV_ITEM

    @property
    def kv_view_bytes(self) -> int:
        return self.attn_layers * 2 * self.block_size * self.kv_row_bytes

    @property
    def heads_per_shard(self) -> int:
        return self.rec_heads // self.shards

    def part_dim(self, part: str) -> int:
        return self.value_dim if part == "v" else self.key_dim

    def conv_part_bytes(self, part: str) -> int:
        return self.heads_per_shard * self.part_dim(part) * self.conv_rows * self.state_item

    @property
    def conv_shard_bytes(self) -> int:
        return sum(self.conv_part_bytes(p) for p in PARTS)

    @property
    def ssm_head_bytes(self) -> int:
        return self.value_dim * self.key_dim * self.state_item

    @property
    def ssm_shard_bytes(self) -> int:
        return self.heads_per_shard * self.ssm_head_bytes

    @property
    def layer_shard_bytes(self) -> int:
        return self.conv_shard_bytes + self.ssm_shard_bytes

    @property
    def shard_bytes(self) -> int:
        return self.rec_layers * self.layer_shard_bytes

    @property
    def state_view_bytes(self) -> int:
        return self.shards * self.shard_bytes

    @property
    def page_bytes(self) -> int:
        raw = max(self.kv_view_bytes, self.state_view_bytes)
        return -(-raw // PAGE_ALIGN) * PAGE_ALIGN

    @property
    def buffer_bytes(self) -> int:
        return self.layout.num_pages * self.page_bytes

    # -- offsets (bytes from the start of the worker's buffer) -----------------------
    def page_offset(self, page: int) -> int:
        return page * self.page_bytes

    def kv_offset(self, page: int, layer: int, kv: int, pos: int) -> int:
        """Start of position ``pos`` of K (kv=0) or V (kv=1) of attention layer ``layer``."""
        return self.page_offset(page) + ((layer * 2 + kv) * self.block_size + pos) * self.kv_row_bytes

    def shard_of(self, head: int) -> tuple[int, int]:
        """(shard, index inside the shard) of recurrent head ``head``."""
        return divmod(head, self.heads_per_shard)

    def conv_part_offset(self, page: int, shard: int, layer: int, part: str, local_head: int = 0) -> int:
        before = sum(self.conv_part_bytes(p) for p in PARTS[: PARTS.index(part)])
        head = local_head * self.part_dim(part) * self.conv_rows * self.state_item
        return (self.page_offset(page) + shard * self.shard_bytes + layer * self.layer_shard_bytes
                + before + head)

    def ssm_offset(self, page: int, shard: int, layer: int, local_head: int = 0) -> int:
        return (self.page_offset(page) + shard * self.shard_bytes + layer * self.layer_shard_bytes
                + self.conv_shard_bytes + local_head * self.ssm_head_bytes)
