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
  has not computed yet), through any of their block tables: a block id is one
  page for every group (the full layers', each window group's).  One read is
  allowed: of the same sequence's same position, by a request the plan lists
  after the writer (the runner computes in plan order; an engine's batch writes
  a layer's KV for every request before any reads it, and vLLM gives a hit on
  full-attention blocks another request of the step is computing).

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


def plan_conflicts(plan: StepPlan, block_size: int, tokens: dict[str, Prefix],
                   windows: tuple[int, ...] = ()) -> list[str]:
    """The plan's contended memory, as sentences (empty: none).  ``tokens``:
    each scheduled request's known tokens (for what a KV position is written for);
    ``windows``: the model's window groups (their tables are read from the window's start)."""
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
    # -- KV positions (a block id is one page for every group: conformance/harness/memory.py) --------
    tables = {rs.request_id: _tables(rs, windows) for rs in plan.requests}
    written_blocks = {rs.request_id: {b for _, table, _ in tables[rs.request_id]
                                      for b in table[rs.start // B: -(-_reach(rs) // B)]} for rs in plan.requests}
    for i, first in enumerate(plan.requests):
        for second in plan.requests[i + 1:]:
            for w, r in ((first, second), (second, first)):
                shared = written_blocks[w.request_id] & {b for _, table, lo in tables[r.request_id]
                                                         for b in table[lo // B: -(-_reach(r) // B)]}
                if shared:
                    problems += _kv_conflicts(w, r, shared, B, tokens, tables, report_writes=w is first)
    return problems


def _reach(rs: RequestStep) -> int:
    """The position after the last one the step computes (its drafts included)."""
    return rs.end + len(rs.drafts)


def _tables(rs: RequestStep, windows: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int]]:
    """(what, table, first position read) of each block table the step uses: the
    full layers' from 0, each window group's from its window's start (without
    window tables the window layers use ``block_table``: nothing more)."""
    out = [("", rs.block_table, 0)]
    for g, table in enumerate(rs.window_tables if windows else ()):
        out.append((f" (window group {g})", tuple(table), max(0, rs.start - windows[g] + 1)))
    return out


def _kv_conflicts(w: RequestStep, r: RequestStep, blocks: set[int], B: int, tokens: dict[str, Prefix],
                  uses: dict, report_writes: bool) -> list[str]:
    """Positions of ``blocks`` that ``w`` writes and ``r`` reads, or writes
    for another sequence (each pair of writers reported once)."""
    writes = {}
    for what, table, _ in uses[w.request_id]:
        for pos in range(w.start, min(_reach(w), len(table) * B)):  # a short table is the runner's error
            b = table[pos // B]
            if b in blocks:
                writes[(b, pos % B)] = (pos, what)
    for r_what, table, lo in uses[r.request_id]:
        for pos in range(lo, min(_reach(r), len(table) * B)):
            b = table[pos // B]
            hit = writes.get((b, pos % B))
            if hit is None:
                continue
            at, w_what = hit
            if pos < r.start:
                if report_writes and tokens[w.request_id][: at + 1] == tokens[r.request_id][: pos + 1]:
                    # The writer comes first in the plan, which the runner computes in order, and writes the
                    # very position the reader reuses: an engine's batch writes every request's KV of a layer
                    # before any request of the batch reads it (vLLM: reshape_and_cache, then attention), and
                    # vLLM gives a hit on full-attention blocks a request of the same step is computing.
                    continue
                return [f"KV block {b} offset {pos % B} is written by {w.request_id}{w_what} (position {at}) and read "
                        f"by {r.request_id}{r_what} (position {pos}, part of its reused prefix) in one step: what it "
                        f"reads depends on the order the step computes them"]
            if report_writes and tokens[w.request_id][: at + 1] != tokens[r.request_id][: pos + 1]:
                return [f"KV block {b} offset {pos % B} is written by two requests of one step for different "
                        f"sequences: {w.request_id}{w_what} (position {at}) and {r.request_id}{r_what} "
                        f"(position {pos})"]
    return []
