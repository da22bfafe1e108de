"""What one step's plan may not ask for: memory that two of its requests
contend for.

The runner computes a plan's requests one after another, an engine computes
them in one batch; where two requests of one step touch the same memory and
one of them writes it, what each gets depends on that order, so no correct
cache ever plans it.  A contract error at ``schedule()`` time, named
precisely, instead of a wrong logit later (and only where some later step
happens to read the bytes):

- a state slot written by two requests of the step (each one's running slot,
  a snapshot target), or written by one and read by another (a copy source,
  a slot resumed);
- a snapshot taken inside the step into the request's own running slot (the
  slot ends the step holding the running state, not the snapshot);
- a KV position (block, offset) written by two requests for different
  sequences, or written by one and read by another (a hit on what the step
  has not computed yet).

A step that verifies drafts writes through them: its draft slots (one per
draft) and the KV positions ``[end, end + len(drafts))``, for the sequence
its drafts continue.  Two requests writing the same position for the same
sequence (one cold prefix computed twice into shared blocks) write the same
bytes: allowed.
Copies and transfers of the plan run before its requests, in order, so what
they touch is no contention.
"""

from __future__ import annotations

from conformance.contract import RequestStep, StepPlan

Prefix = tuple[int, ...]


def _state_uses(rs: RequestStep) -> tuple[dict[int, str], dict[int, str]]:
    """(slots the step writes, slots it reads), each with the role it plays."""
    writes = {rs.state_slot: "running slot"}
    for i, slot in enumerate(rs.draft_slots):
        writes.setdefault(slot, f"draft slot {i}")
    for pos, slot in rs.snapshots:
        writes.setdefault(slot, f"snapshot target at {pos}")
    reads: dict[int, str] = {}
    if rs.state_init.kind == "copy" and rs.state_init.source is not None:
        reads[rs.state_init.source] = "copy source"
    elif rs.state_init.kind == "resume":
        reads[rs.state_slot] = "resumed slot"
    return writes, reads


def plan_conflicts(plan: StepPlan, block_size: int, tokens: dict[str, Prefix]) -> list[str]:
    """The plan's contended memory, as sentences (empty: none).  ``tokens``:
    each scheduled request's known tokens (for what a KV position is written for)."""
    problems: list[str] = []
    B = block_size
    tokens = {rs.request_id: tuple(tokens[rs.request_id]) + tuple(rs.drafts) for rs in plan.requests}
    for rs in plan.requests:
        inside = [(p, s) for p, s in rs.snapshots if s == rs.state_slot and p < rs.end]
        if inside:
            problems.append(f"{rs.request_id} snapshots position {inside[0][0]} into its own running slot "
                            f"{rs.state_slot}, which ends the step holding the state at {rs.end}")
    if len(plan.requests) < 2:
        return problems
    # -- state slots ----------------------------------------------------------------------
    uses = [(rs.request_id, *_state_uses(rs)) for rs in plan.requests]
    for i, (a, a_writes, a_reads) in enumerate(uses):
        for b, b_writes, b_reads in uses[i + 1:]:
            for slot in sorted(a_writes.keys() & b_writes.keys()):
                problems.append(f"state slot {slot} is written by two requests of one step: {a} ({a_writes[slot]}) "
                                f"and {b} ({b_writes[slot]})")
            for (writer, writes), (reader, reads) in (((a, a_writes), (b, b_reads)), ((b, b_writes), (a, a_reads))):
                for slot in sorted(writes.keys() & reads.keys()):
                    problems.append(f"state slot {slot} is {writer}'s {writes[slot]} and {reader}'s {reads[slot]} "
                                    f"in one step: what {reader} reads depends on the order the step computes them")
    # -- KV positions ---------------------------------------------------------------------
    written_blocks = {rs.request_id: set(rs.block_table[rs.start // B: -(-_reach(rs) // B)]) for rs in plan.requests}
    for i, first in enumerate(plan.requests):
        for second in plan.requests[i + 1:]:
            for w, r in ((first, second), (second, first)):
                shared = written_blocks[w.request_id] & set(r.block_table[: -(-_reach(r) // B)])
                if shared:
                    problems += _kv_conflicts(w, r, shared, B, tokens, report_writes=w is first)
    return problems


def _reach(rs: RequestStep) -> int:
    """The position after the last one the step computes (its drafts included)."""
    return rs.end + len(rs.drafts)


def _kv_conflicts(w: RequestStep, r: RequestStep, blocks: set[int], B: int, tokens: dict[str, Prefix],
                  report_writes: bool) -> list[str]:
    """Positions of ``blocks`` that ``w`` writes and ``r`` reads, or writes
    for another sequence (each pair of writers reported once)."""
    writes = {}
    for pos in range(w.start, min(_reach(w), len(w.block_table) * B)):  # a short table is the runner's error
        b = w.block_table[pos // B]
        if b in blocks:
            writes[(b, pos % B)] = pos
    for pos in range(0, min(_reach(r), len(r.block_table) * B)):
        b = r.block_table[pos // B]
        at = writes.get((b, pos % B))
        if at is None:
            continue
        if pos < r.start:
            return [f"KV block {b} offset {pos % B} is written by {w.request_id} (position {at}) and read by "
                    f"{r.request_id} (position {pos}, part of its reused prefix) in one step: what it reads "
                    f"depends on the order the step computes them"]
        if report_writes and tokens[w.request_id][: at + 1] != tokens[r.request_id][: pos + 1]:
            return [f"KV block {b} offset {pos % B} is written by two requests of one step for different "
                    f"sequences: {w.request_id} (position {at}) and {r.request_id} (position {pos})"]
    return []
