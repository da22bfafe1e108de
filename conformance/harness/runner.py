"""Executes one step's plan on memory with the model, as an engine's model
runner would.  It trusts nothing but memory: the state it extends is whatever
the slot holds, the KV it attends to is whatever the block table points at."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.contract import RequestStep, StepPlan, TransferDone
from conformance.errors import ContractError
from conformance.harness.memory import Memory, Prefix
from conformance.harness.oracle import Verdict
from conformance.harness.transport import Transport
from conformance.model import TinyHybrid


@dataclass(frozen=True)
class Executed:
    """One request's step, computed: what the checkers of ``computed`` are shown."""

    step: RequestStep
    logits: torch.Tensor | None  # [end - start, vocab]; None: not computed (a dry step of the pool probe)
    reads: str  # provenance of what was read, for explanations
    loads_read: frozenset[int] = frozenset()  # ids of the tier loads whose bytes the step read
    # The no-cache oracle's verdict on the logits (the session measures it
    # before the checkers see the step); None: not judged (a dry step).
    verdict: Verdict | None = None


def _describe(prefix: Prefix | None, wanted: Prefix) -> str:
    if prefix is None:
        return "never written (poison)"
    if prefix == wanted:
        return "ok"
    if wanted[: len(prefix)] == prefix:
        return f"state after {len(prefix)} tokens of this sequence (wanted {len(wanted)})"
    return f"state after {len(prefix)} tokens of another sequence"


class Runner:
    def __init__(self, model: TinyHybrid, memory: Memory):
        self.model = model
        self.memory = memory
        self.transport = Transport(memory)  # the host tier; faults interpose on it
        self.completed: list[TransferDone] = []  # this step's transfer completions, for update()
        # Dry steps (the pool probe): plans are validated and executed on provenance
        # only, the model is not run and nothing is judged; the session ends after.
        self.dry = False

    def run_transfers(self, plan: StepPlan) -> list[TransferDone]:
        self.completed = self.transport.run(tuple(plan.transfers))
        return self.completed

    def execute(self, plan: StepPlan, tokens: dict[str, Prefix]) -> list[Executed]:
        mem = self.memory
        self.run_transfers(plan)
        for src, dst in plan.kv_copies:
            mem.copy_block(src, dst)
        for src, dst in plan.state_copies:
            mem.copy_state(src, dst)
        seen: set[str] = set()
        out = []
        for rs in plan.requests:
            if rs.request_id in seen:
                raise ContractError(f"request {rs.request_id} scheduled twice in one step")
            seen.add(rs.request_id)
            out.append(self._run_one(rs, tokens[rs.request_id]))
        return out

    def _run_one(self, rs: RequestStep, seq: Prefix) -> Executed:
        mem = self.memory
        if not 0 <= rs.start < rs.end <= len(seq):
            raise ContractError(f"{rs.request_id}: range [{rs.start}, {rs.end}) outside the "
                                f"{len(seq)} known tokens")
        bad = [p for p, _ in rs.snapshots if not rs.start < p <= rs.end]
        if bad:
            raise ContractError(f"{rs.request_id}: snapshot positions {bad} outside ({rs.start}, {rs.end}]")
        mem.check_slot(rs.state_slot)
        if rs.state_init.kind == "fresh":
            mem.zero_state(rs.state_slot)
        elif rs.state_init.kind == "copy":
            assert rs.state_init.source is not None  # StateInit validates it
            parts = rs.state_init.parts
            mem.copy_state(rs.state_init.source, rs.state_slot, conv="conv" in parts, ssm="ssm" in parts)
        wanted = seq[: rs.start]
        conv_p, ssm_p = mem.state_holds(rs.state_slot)
        bad_kv = mem.kv_holds(rs.block_table, seq, 0, rs.start)
        reads = (f"state slot {rs.state_slot}: conv {_describe(conv_p, wanted)}, matrix {_describe(ssm_p, wanted)}; "
                 f"KV [0, {rs.start}): " + ("ok" if bad_kv is None else f"wrong from position {bad_kv}"))
        if self.dry:  # validated as a read would be, then provenance only
            for b in rs.block_table[: -(-rs.start // mem.layout.block_size)]:
                mem.check_block(b)
            loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot)
            self.transport.computed(rs.request_id, loaded)
            mem.mark_kv(rs.block_table, rs.start, rs.end, seq)
            mem.mark_state(rs.state_slot, seq[: rs.end])
            for pos, slot in rs.snapshots:
                mem.mark_state(slot, seq[:pos])
            return Executed(rs, None, reads, loaded)
        past = mem.read_kv(rs.block_table, rs.start)
        states = mem.read_state(rs.state_slot)
        loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot)
        self.transport.computed(rs.request_id, loaded)
        res = self.model.step(seq[rs.start: rs.end], rs.start, past, states,
                              capture=tuple(p for p, _ in rs.snapshots))
        mem.write_kv(rs.block_table, rs.start, res.new_kv, seq)
        mem.write_state(rs.state_slot, res.states, seq[: rs.end])
        for pos, slot in rs.snapshots:
            mem.write_state(slot, res.captured[pos], seq[:pos])
        return Executed(rs, res.logits, reads, loaded)
