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
from conformance.model import RecState, TinyHybrid


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
    # What the step's window layers read that memory does not hold for this
    # sequence, by provenance, as sentences (empty: every position held);
    # measured before the step wrote anything.
    window_misreads: tuple[str, ...] = ()


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
        # Snapshots at draft positions, held until the verifier decides (commit_snapshots).
        self.deferred: dict[str, list[tuple[int, int, list[RecState] | None, Prefix]]] = {}

    def run_transfers(self, plan: StepPlan) -> list[TransferDone]:
        self.completed = self.transport.run(tuple(plan.transfers))
        return self.completed

    # Under inference mode, as an engine's model runner is: no autograd
    # bookkeeping on any operation (its per-operation cost is most of a
    # decode step on these tiny tensors).  Everything that outlives the step
    # is copied into memory or the host tier, or only read afterwards.
    @torch.inference_mode()
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

    # -- sliding-window layers -------------------------------------------------------
    def window_tables(self, rs: RequestStep) -> tuple[tuple[int, ...], ...]:
        """The block table of each window group: the step's own, or (none given)
        ``block_table`` for every group, as an engine that keeps every attention
        layer in one group reads them."""
        groups = self.memory.windows
        if not groups:
            if rs.window_tables:
                raise ContractError(f"{rs.request_id}: {len(rs.window_tables)} window tables, but the model has no "
                                    f"window layers")
            return ()
        if not rs.window_tables:
            return (rs.block_table,) * len(groups)
        if len(rs.window_tables) != len(groups):
            raise ContractError(f"{rs.request_id}: {len(rs.window_tables)} window tables for the model's "
                                f"{len(groups)} window groups (windows {list(groups)})")
        return tuple(tuple(t) for t in rs.window_tables)

    def _read_windows(self, tables, start: int) -> list[tuple]:
        """K and V each window layer reads, in layer order."""
        mem = self.memory
        per_group = [iter(mem.read_window(g, table, start)) for g, table in enumerate(tables)]
        return [next(per_group[g]) for g in mem.layer_groups]

    def _write_windows(self, tables, start: int, new_win, seq: Prefix) -> None:
        mem = self.memory
        grouped: list[list] = [[] for _ in tables]
        for g, kv in zip(mem.layer_groups, new_win):
            grouped[g].append(kv)
        for g, table in enumerate(tables):
            mem.write_window(g, table, start, grouped[g], seq)

    def _misreads(self, tables, seq: Prefix, start: int) -> tuple[str, ...]:
        return tuple(m for g, table in enumerate(tables) for m in self.memory.window_misreads(g, table, seq, start))

    def _read_full(self, rs: RequestStep) -> list:
        """The full attention layers' KV of [0, start) (a model without them reads nothing)."""
        if not self.model.config.num_attn_layers:
            return []
        return self.memory.read_kv(rs.block_table, rs.start)

    def _write_full(self, rs: RequestStep, new_kv, seq: Prefix) -> None:
        if self.model.config.num_attn_layers:
            self.memory.write_kv(rs.block_table, rs.start, new_kv, seq)

    def _mark(self, rs: RequestStep, tables, end: int, seq: Prefix) -> None:
        mem = self.memory
        if self.model.config.num_attn_layers:
            mem.mark_kv(rs.block_table, rs.start, end, seq)
        for g, table in enumerate(tables):
            mem.mark_window(g, table, rs.start, end, seq)

    def _run_one(self, rs: RequestStep, seq: Prefix) -> Executed:
        if rs.drafts or rs.draft_slots:
            return self._verify_one(rs, seq)
        mem = self.memory
        if not 0 <= rs.start < rs.end <= len(seq):
            raise ContractError(f"{rs.request_id}: range [{rs.start}, {rs.end}) outside the "
                                f"{len(seq)} known tokens")
        bad = [p for p, _ in rs.snapshots if not rs.start < p <= rs.end]
        if bad:
            raise ContractError(f"{rs.request_id}: snapshot positions {bad} outside ({rs.start}, {rs.end}]")
        tables = self.window_tables(rs)
        reads = self._init_state(rs, seq)
        misreads = self._misreads(tables, seq, rs.start)
        if self.dry:  # validated as a read would be, then provenance only
            if self.model.config.num_attn_layers:
                for b in rs.block_table[: -(-rs.start // mem.layout.block_size)]:
                    mem.check_block(b)
            loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot, tables)
            self.transport.computed(rs.request_id, loaded)
            self._mark(rs, tables, rs.end, seq)
            mem.mark_state(rs.state_slot, seq[: rs.end])
            for pos, slot in rs.snapshots:
                mem.mark_state(slot, seq[:pos])
            return Executed(rs, None, reads, loaded, window_misreads=misreads)
        past = self._read_full(rs)
        past_win = self._read_windows(tables, rs.start)
        states = mem.read_state(rs.state_slot)
        loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot, tables)
        self.transport.computed(rs.request_id, loaded)
        res = self.model.step(seq[rs.start: rs.end], rs.start, past, states,
                              capture=tuple(p for p, _ in rs.snapshots), past_win=past_win)
        self._write_full(rs, res.new_kv, seq)
        self._write_windows(tables, rs.start, res.new_win, seq)
        mem.write_state(rs.state_slot, res.states, seq[: rs.end])
        for pos, slot in rs.snapshots:
            mem.write_state(slot, res.captured[pos], seq[:pos])
        return Executed(rs, res.logits, reads, loaded, window_misreads=misreads)

    def _init_state(self, rs: RequestStep, seq: Prefix) -> str:
        """The running slot's starting state (fresh, resumed or copied), and
        what the step reads, in words."""
        mem = self.memory
        mem.check_slot(rs.state_slot)
        if rs.state_init.kind == "fresh":
            mem.zero_state(rs.state_slot)
        elif rs.state_init.kind == "copy":
            assert rs.state_init.source is not None  # StateInit validates it
            parts = rs.state_init.parts
            mem.copy_state(rs.state_init.source, rs.state_slot, conv="conv" in parts, ssm="ssm" in parts)
        wanted = seq[: rs.start]
        conv_p, ssm_p = mem.state_holds(rs.state_slot)
        bad_kv = mem.kv_holds(rs.block_table, seq, 0, rs.start) if self.model.config.num_attn_layers else None
        words = (f"state slot {rs.state_slot}: conv {_describe(conv_p, wanted)}, matrix {_describe(ssm_p, wanted)}; "
                 f"KV [0, {rs.start}): " + ("ok" if bad_kv is None else f"wrong from position {bad_kv}"))
        if mem.windows:
            bad = self._misreads(self.window_tables(rs), seq, rs.start)
            words += "; windows: " + ("ok" if not bad else "; ".join(bad))
        return words

    # -- speculative decoding: a verification step ------------------------------------
    def _verify_one(self, rs: RequestStep, seq: Prefix) -> Executed:
        """A step that verifies draft tokens: the model computes the real tokens
        [start, end) and then the drafts at [end, end + k), as one chunk (an
        engine's verification batch), with logits at every position.  KV is
        written for all of them (a rejected draft's KV stays in memory, with its
        provenance, until something overwrites it).  With ``draft_slots`` the
        running slot keeps the state after ``end`` and draft slot i the state
        after ``end + i + 1``; without, the running slot is extended through
        every draft.  The session decides acceptance afterwards, from the
        oracle; memory only records what was computed.  A snapshot at a draft
        position is held back until then (:meth:`commit_snapshots`): it is
        taken only where the verifier accepts through it."""
        mem = self.memory
        k = len(rs.drafts)
        if not k:
            raise ContractError(f"{rs.request_id}: draft_slots {list(rs.draft_slots)} given without drafts")
        if not 0 <= rs.start < rs.end == len(seq):
            raise ContractError(f"{rs.request_id}: a step with drafts must compute through the sequence's last "
                                f"token ({len(seq)}), not [{rs.start}, {rs.end})")
        if rs.draft_slots and len(rs.draft_slots) != k:
            raise ContractError(f"{rs.request_id}: {len(rs.draft_slots)} draft slots for {k} drafts (one per draft, "
                                f"or none for a rollback scheme)")
        slots = (rs.state_slot, *rs.draft_slots)
        if len(set(slots)) != len(slots):
            raise ContractError(f"{rs.request_id}: the running slot and the draft slots {list(slots)} must be "
                                f"distinct (each verified position's state has its own slot)")
        for slot in rs.draft_slots:
            mem.check_slot(slot)
        last = rs.end + k
        bad = [p for p, _ in rs.snapshots if not rs.start < p <= last]
        if bad:
            raise ContractError(f"{rs.request_id}: snapshot positions {bad} outside ({rs.start}, {last}]")
        full = seq + tuple(rs.drafts)
        tables = self.window_tables(rs)
        reads = self._init_state(rs, seq)
        misreads = self._misreads(tables, seq, rs.start)
        columns = {rs.end + i: slot for i, slot in enumerate(slots)} if rs.draft_slots else {last: rs.state_slot}
        now = tuple((p, slot) for p, slot in rs.snapshots if p <= rs.end)
        later = tuple((p, slot) for p, slot in rs.snapshots if p > rs.end)
        if self.dry:
            if self.model.config.num_attn_layers:
                for b in rs.block_table[: -(-rs.start // mem.layout.block_size)]:
                    mem.check_block(b)
            loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot, tables)
            self.transport.computed(rs.request_id, loaded)
            self._mark(rs, tables, last, full)
            for pos, slot in (*columns.items(), *now):
                mem.mark_state(slot, full[:pos])
            self.deferred[rs.request_id] = [(pos, slot, None, full[:pos]) for pos, slot in later]
            return Executed(rs, None, reads, loaded, window_misreads=misreads)
        past = self._read_full(rs)
        past_win = self._read_windows(tables, rs.start)
        states = mem.read_state(rs.state_slot)
        loaded = mem.loads_read(rs.block_table, rs.start, rs.state_slot, tables)
        self.transport.computed(rs.request_id, loaded)
        capture = tuple(sorted({*columns, *(p for p, _ in rs.snapshots)} - {last}))
        res = self.model.step(full[rs.start: last], rs.start, past, states, capture=capture, past_win=past_win)
        self._write_full(rs, res.new_kv, full)
        self._write_windows(tables, rs.start, res.new_win, full)
        for pos, slot in (*columns.items(), *now):
            mem.write_state(slot, res.states if pos == last else res.captured[pos], full[:pos])
        self.deferred[rs.request_id] = [(pos, slot, res.states if pos == last else res.captured[pos], full[:pos])
                                        for pos, slot in later]
        return Executed(rs, res.logits, reads, loaded, window_misreads=misreads)

    def commit_snapshots(self, request_id: str, accepted_end: int) -> None:
        """The verifier accepted through ``accepted_end``: the snapshots held
        back at draft positions up to it are taken (as an engine copies the
        accepted column after verification, vLLM's ``postprocess_mamba``),
        the others never are.  After every request's step of the plan ran."""
        for pos, slot, states, prefix in self.deferred.pop(request_id, ()):
            if pos <= accepted_end:
                if states is None:
                    self.memory.mark_state(slot, prefix)
                else:
                    self.memory.write_state(slot, states, prefix)
