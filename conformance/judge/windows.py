"""Sliding-window layers (issue 35): what a step's window layers read, judged
from memory, and the situations a window run reached.

A window layer of window W at position q reads the KV of [q - W + 1, q]:
a step [start, end) of window group g reads [start - W + 1, start) from
memory (through ``RequestStep.window_tables[g]``, or ``block_table`` for a
cache that keeps no window tables) and writes [start, end).  Blocks wholly
before what it reads may have been freed, nulled or reused: nothing judges
them.  What it reads is judged here, from provenance, before the step writes
anything (the runner measures it: ``Executed.window_misreads``):

- **WindowReadsHeld**: every position a computed step's window layers read
  holds the KV of this sequence's prefix through that position.  That covers
  a prefix hit on a window group (it needs the window's blocks at the hit
  point, whatever the other groups matched: the hit is one length in tokens
  for every group, ``RequestStep.start``), a block freed and reused while a
  step in flight still reads it (the refcounts of every block a step reads
  are ``invariants.TablesReferenced``'s, the bytes are this judge's), a freed
  block served as a hit, and a block listed as cached that no longer holds
  its prefix (``invariants.check_view``, which knows window groups' entries).

**WindowCoverage** counts, from memory, provenance and the harness's own
tracks (never from what the cache says of itself), the window histories a
check requires (``suite/checks.py``, family "window"):

- ``window_prompts_past_window``: a prompt longer than every window computed
  to its end (some blocks of every group left the window on the way);
- ``window_chunks_across``: a later prefill chunk that starts at or past every
  window (its window layers read only what earlier chunks wrote, and the
  prompt's first blocks are no longer read);
- ``window_hits_past_freed``: a prefix hit whose window starts past 0 in some
  group where memory no longer holds a position before that window (by
  provenance: its blocks were freed and written over), so the hit stands on
  the window's blocks alone;
- ``window_extended_hits``: a hit on a prompt that extends an earlier prompt
  ending inside a block, reaching that prompt's last aligned block (vllm#57610:
  a prompt extended by a few tokens in the same turn);
- ``window_aborts_mid_window``: an abort of a request that had computed past
  every window (it held blocks in its window, and had let earlier ones go);
- ``window_drafts_rejected_across_edge``: a verification whose rejected drafts
  straddle the window's edge: had every draft been accepted, a block of some
  group would have left the window that the next step still reads
  (vllm#47728's rollback below already-nulled blocks);
- ``window_offloads_leaving``: an offload of a window group's block whose
  positions lie wholly before the window of a running request of that
  sequence (a block leaving the window, stored before it is reused);
- ``window_blocks_let_go``: a step whose window table holds a null entry
  before its window (the cache let a block go while the request runs).  A
  cache that never does (a correct design: every attention layer in one
  group) cannot produce the counters of ``NEEDS_LETTING_GO``; a check does not
  ask it for them, and says so.

The pool probe's requests are not counted.  Nothing here runs for a model
without window layers.
"""

from __future__ import annotations

from conformance.contract import NULL_BLOCK
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker

Prefix = tuple[int, ...]

WINDOW_COUNTERS = ("window_prompts_past_window", "window_chunks_across", "window_hits_past_freed",
                   "window_extended_hits", "window_aborts_mid_window", "window_drafts_rejected_across_edge",
                   "window_offloads_leaving", "window_blocks_let_go")
# What only a cache that lets window blocks go while a request runs can produce: a cache
# that keeps them all (no window tables: one group for every attention layer) is not
# asked for them (suite/execute.py, by observation of window_blocks_let_go).
NEEDS_LETTING_GO = ("window_hits_past_freed", "window_offloads_leaving")


class WindowReadsHeld(Checker):
    """What a computed step's window layers read is this sequence's KV (see the module)."""

    name = "window-reads"

    def computed(self, obs, executed):
        if executed.window_misreads and executed.logits is not None:
            rs = executed.step
            raise ConformanceFailure("invariant", f"window: {rs.request_id}'s step [{rs.start}, {rs.end}) "
                                                  f"{executed.window_misreads[0]}")


class WindowCoverage(Checker):
    """The window histories a run reached (see the module)."""

    name = "window-coverage"

    def __init__(self):
        super().__init__()
        self.windows: tuple[int, ...] = ()
        self.prompts: list[Prefix] = []  # prompts of the session so far, in order
        # request -> the longest earlier prompt it extends that ended inside a block (0: none)
        self.extends: dict[str, int] = {}

    def attached(self, obs):
        self.windows = obs.memory.windows
        if self.windows:
            for key in WINDOW_COUNTERS:
                self.coverage.setdefault(key, 0)

    def submitted(self, obs, ev):
        if not self.windows or obs.probing:
            return
        prompt = ev.request.prompt
        self.extends[ev.request.request_id] = max(
            (len(p) for p in self.prompts
             if len(p) % obs.layout.block_size and len(p) < len(prompt) and prompt[: len(p)] == p), default=0)
        self.prompts.append(prompt)

    def scheduled(self, obs, ev):
        if not self.windows or obs.probing:
            return
        B, widest = obs.layout.block_size, max(self.windows)
        for rs in ev.plan.requests:
            track = obs.tracks[rs.request_id]
            first = track.computed is None
            self.count("window_blocks_let_go", any(NULL_BLOCK in t[: max(0, rs.start - w + 1) // B]
                                                   for t, w in zip(rs.window_tables, self.windows)))
            if rs.end == track.prompt_len and track.prompt_len > widest and rs.start < track.prompt_len:
                self.count("window_prompts_past_window")
            if not first and rs.start >= widest and rs.start < track.prompt_len:
                self.count("window_chunks_across")
            if first and rs.start > 0:
                if self._past_freed(obs, track.tokens, rs.start):
                    self.count("window_hits_past_freed")
                extended = self.extends.get(rs.request_id, 0)
                self.count("window_extended_hits", bool(extended) and rs.start >= extended // B * B)
        for t in ev.plan.transfers:
            if t.direction == "offload" and t.kind == "kv" and t.window_group is not None:
                self.count("window_offloads_leaving", self._leaving(obs, t.window_group, t.device))

    def stepped(self, obs, record):
        if not self.windows or obs.probing:
            return
        B = obs.layout.block_size
        for rs in record.plan.requests:
            k = len(rs.drafts)
            track = obs.tracks.get(rs.request_id)
            if not k or track is None or track.computed is None:
                continue
            accepted = track.computed - rs.end
            if accepted < k and any((rs.end + k - w + 1) // B > max(0, rs.end + accepted - w + 1) // B
                                    for w in self.windows if rs.end + k - w + 1 > 0):
                self.count("window_drafts_rejected_across_edge")

    def aborted(self, obs, ev):
        if not self.windows or obs.probing:
            return
        track = obs.tracks[ev.request_id]
        if track.computed is not None and track.computed >= max(self.windows):
            self.count("window_aborts_mid_window")

    # -- from memory ---------------------------------------------------------------------
    def _past_freed(self, obs, tokens: Prefix, start: int) -> bool:
        """Some group's window at ``start`` starts past 0, and memory holds in
        that group no more the KV of some position before it."""
        mem = obs.memory
        for g, w in enumerate(self.windows):
            first = start - w + 1
            if first <= 0:
                continue
            held = {p for row in mem.win_prov[g] for p in row if p is not None and len(p) <= first}
            if any(tokens[: q + 1] not in held for q in range(first)):
                return True
        return False

    def _leaving(self, obs, group: int, block: int) -> bool:
        """The block holds positions wholly before the window of a running
        request of that sequence (its next step reads from there on)."""
        mem = obs.memory
        if not 0 <= block < len(mem.win_prov[group]):
            return False
        row = [p for p in mem.win_prov[group][block] if p is not None]
        if not row:
            return False
        last = max(row, key=len)
        w = self.windows[group]
        for rid in obs.active():
            track = obs.tracks[rid]
            if track.computed is not None and track.tokens[: len(last)] == last \
                    and len(last) <= track.computed - w + 1:
                return True
        return False
