"""Executes one worker-tagged :class:`RequestStep` on that worker's memory
with the harness's model, as :class:`conformance.harness.runner.Runner` does for the
single-worker memory.

The decode worker runs a paged *decode kernel*: it reads whole KV blocks
(tiles) and masks the positions past the last token, so a stale tail is read
-- harmless when finite (its weight is exactly 0) but poison when not
(0 * NaN), which is why engines zero untransferred tails.  The decode side is
also audited byte by byte: every byte it reads that memory's provenance does
not give to the request's tokens (nor to a zeroed tail) is reported
(``WorkerExecuted.stale``), measured before the step writes; the checkers of
:mod:`conformance.judge.disagg` judge it.  The prefill worker reads exact
ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conformance.contract import RequestStep
from conformance.errors import ContractError
from conformance.model import TinyHybrid

from .audit import audit_kv, audit_state, audit_tail
from .worker_memory import WorkerMemory


@dataclass
class WorkerExecuted:
    step: RequestStep
    logits: torch.Tensor
    stale: list[str] = field(default_factory=list)  # bytes read that were not its own (decode side)


def run_step(model: TinyHybrid, mem: WorkerMemory, rs: RequestStep, seq: tuple[int, ...],
             tile_kernel: bool) -> WorkerExecuted:
    if not 0 <= rs.start < rs.end <= len(seq):
        raise ContractError(f"{rs.request_id}: range [{rs.start}, {rs.end}) outside the {len(seq)} known tokens")
    bad = [p for p, _ in rs.snapshots if not rs.start < p <= rs.end]
    if bad:
        raise ContractError(f"{rs.request_id}: snapshot positions {bad} outside ({rs.start}, {rs.end}]")
    mem.check_page(rs.state_slot)
    if rs.state_init.kind == "fresh":
        if rs.start != 0:
            raise ContractError(f"{rs.request_id}: a fresh state at position {rs.start} (only at 0)")
        mem.zero_state(rs.state_slot, rs.request_id)
    elif rs.state_init.kind == "copy" and rs.state_init.source is not None:
        parts = rs.state_init.parts
        mem.copy_state(rs.state_init.source, rs.state_slot, conv="conv" in parts, ssm="ssm" in parts)
    stale = []
    if tile_kernel:
        for p in (audit_kv(mem, rs.block_table, seq, rs.start), audit_state(mem, rs.state_slot, seq[: rs.start])):
            if p:
                stale.append(p)
    past = mem.read_kv(rs.block_table, rs.start)
    states = mem.read_state(rs.state_slot)
    res = model.step(seq[rs.start: rs.end], rs.start, past, states, capture=tuple(p for p, _ in rs.snapshots))
    mem.write_kv(rs.block_table, rs.start, res.new_kv, seq, rs.request_id)
    mem.write_state(rs.state_slot, res.states, seq[: rs.end], rs.request_id)
    for pos, slot in rs.snapshots:
        mem.write_state(slot, res.captured[pos], seq[:pos], rs.request_id)
    logits = res.logits
    if tile_kernel:
        tail = mem.kv_tail(rs.block_table, rs.end)
        if tail is not None:
            page, first, _ = tail
            # The masked part of the last tile: weight 0, so only a non-finite byte shows.
            logits = logits + 0.0 * mem.tail_values(page, first).sum()
            p = audit_tail(mem, page, first, rs.request_id)
            if p:
                stale.append(p)
    return WorkerExecuted(rs, logits, stale)
