"""Coverage of the hard histories measured from memory and provenance (issue 25).

The counters of :mod:`conformance.judge.hard_coverage` are mostly measured
from the implementation's view (what it stopped listing) or from the shapes
of prompts; a cache can list an eviction that never overwrote anything, and
an eviction can happen in a step without touching what the bug needs.  These
count the situation itself, from what the harness's memory holds (every KV
position and state slot carries the prefix whose computation produced it),
the harness's own record of each request (tracks, block tables it ran
through) and the host store's provenance.  An entry is *cached* when the view
lists it; memory proved every listing honest (``invariants.check_view``), and
a counter here never takes a listing alone for an eviction: an entry is
*overwritten* when memory no longer holds its content.

- ``cached_overwritten_while_running``: a step overwrote a block or a slot
  whose content a listed cached entry was (listed at the schedule, or for a
  block at any earlier view), while another request was mid-prefill or
  mid-decode (had run and not finished);
- ``evictions_past_running_entry``: such an overwrite of a KV entry that was
  listed and used (published, or read by a hit) no earlier than another
  listed KV entry that a running request still has in its block table and
  that no other block holds: an eviction that, in an order by age that
  forgot the running request's reference, would have taken the running
  request's block (issue 25's first history: a decoding request's published
  prompt while a new long prompt needs blocks);
- ``aborts_before_copied_block_complete``: an abort of a request whose hit
  ended inside a block, while the block its table holds there (the copy) has
  the hit's positions (memory) and not yet the block's end: the request had
  not finished the copy-on-write block it started in;
- ``mid_block_chunks_after_mid_block_hit``: a request's first step starts
  inside a block (a hit ending there) and ends inside a block before the
  prompt's end (vllm#51763: a second off-grid stop after a mid-block hit);
- ``short_chunks_from_snapshot``: a first step that starts from a cached
  snapshot (copied, or resumed from a slot the plan's state copies or a load
  filled) and computes fewer tokens than the conv window (vllm#56196);
  ``short_chunks_rounded_up``: such a step whose budget asked for fewer, of a
  prompt that had more, and which computed at least the window (a cache that
  rounds a chunk up to a page: SGLang's pages of 4);
- ``aba_displaced``: a prompt asked for again when memory holds less of what
  could serve it (KV and a state, by provenance) than it held when the
  prompt's earlier request finished: its entries were overwritten meanwhile
  (the prompt, or the prompt and its first output token: under prompt-end
  retention only the second can reuse the state at the prompt's end);
- ``divergences_inside_held_block``: a prompt whose longest prefix memory
  holds the KV of ends inside a block, where memory holds another
  sequence's next position: the prompt diverges, inside a block, from content
  memory still holds (the shape counters of ``hard_coverage`` compare with
  every earlier sequence, held or not);
- ``state_outlives_kv``: a prompt arrives while a listed state holds a
  longer prefix of it than the KV memory holds (vllm#46453: attention evicted,
  a deeper recurrent state survives); ``state_outlives_held_kv``: the same
  while memory still holds a KV prefix of it (the groups' hits disagree, both
  above 0: a cache that combines them by their maximum starts past KV it
  never found);
- ``states_gone_with_kv``: memory lost KV below a state the cache had
  listed (with that KV whole in memory when it was listed), and the state
  was no longer listed by then: a chance for a state to outlive its KV that
  the cache's design did not take (a radix tree that evicts a node's state
  with its KV; :data:`conformance.judge.coverage.WAIVERS`);
- ``mid_block_reuse_held``: a prompt arrives while the longest prefix of it
  whose KV and state memory holds whole ends inside a block: a chance for
  a hit that ends inside a block, whichever design the cache has;
- ``tier_hits_over_local`` / ``tier_hits_over_mid_block_local``: a hit whose
  first step read bytes a tier load landed (memory's load ids) and started
  past the longest prefix the device could serve when the prompt arrived
  (the listed, memory-held KV and state), which was above 0 (and, for the
  second, ended inside a block): the remote tier won the comparison against
  a local hit, where every group must be reconciled to the remote length and
  a block held for the local tail given back.

The pool probe's requests (``obs.probing``) are not counted.
"""

from __future__ import annotations

from conformance.harness.checker import Checker
from conformance.judge.reuse import INDEXES

Prefix = tuple[int, ...]

MEMORY_COUNTERS = ("cached_overwritten_while_running", "evictions_past_running_entry",
                   "aborts_before_copied_block_complete", "mid_block_chunks_after_mid_block_hit",
                   "short_chunks_from_snapshot", "aba_displaced", "divergences_inside_held_block",
                   "state_outlives_kv", "state_outlives_held_kv", "tier_hits_over_local",
                   "tier_hits_over_mid_block_local", "states_gone_with_kv", "mid_block_reuse_held",
                   "short_chunks_rounded_up")


class Held:
    """What memory holds right now, by provenance: every KV position's prefix
    and every whole state (conv and matrix parts of the same prefix)."""

    def __init__(self, memory):
        self.kv: set[Prefix] = {p for row in memory.kv_prov for p in row if p}
        self.states: set[Prefix] = {c for c, s in zip(memory.conv_prov, memory.ssm_prov, strict=True)
                                    if c is not None and c == s}

    def diverges_inside_a_block(self, prompt: Prefix, block_size: int) -> bool:
        """The longest prefix of ``prompt`` whose KV memory holds ends inside a
        block and before the prompt's end, and memory holds a position after
        it of another sequence: they part there."""
        n = self.kv_len(prompt)
        if not 0 < n < len(prompt) or n % block_size == 0:
            return False
        head = prompt[:n]
        return any(len(p) == n + 1 and p[:n] == head for p in self.kv)

    def kv_whole(self, prefix: Prefix, block_size: int) -> bool:
        """Memory holds the KV of every block of ``prefix`` (by each block's
        last position, and the prefix's own last one: a block's positions are
        written together, by the computation of one sequence)."""
        ends = (*range(block_size, len(prefix), block_size), len(prefix))
        return all(prefix[:n] in self.kv for n in ends)

    def kv_len(self, prompt: Prefix) -> int:
        """Longest n such that memory holds the KV of every position of ``prompt[:n]``."""
        n = 0
        while n < len(prompt) and prompt[: n + 1] in self.kv:
            n += 1
        return n

    def reuse(self, prompt: Prefix) -> int:
        """Longest p < len(prompt) whose KV and state memory holds whole."""
        for p in range(min(self.kv_len(prompt), len(prompt) - 1), 0, -1):
            if prompt[:p] in self.states:
                return p
        return 0


class MemoryHistoryCoverage(Checker):
    name = "memory-coverage"

    def __init__(self):
        super().__init__()
        self.tables: dict[str, tuple[int, ...]] = {}  # request -> the block table of its latest step
        self.first_start: dict[str, int] = {}
        self.last_use: dict[tuple[int, Prefix], int] = {}  # listed KV entry -> step it was listed or hit
        self.before: tuple | None = None  # (listed KV, listed states, running, in-use entries) at the schedule
        self.finished_held: dict[Prefix, int] = {}  # prompt -> what memory could serve when its request finished
        self.seen_done: set[str] = set()
        self.local: dict[str, int] = {}  # request -> the device's reuse for its prompt at submission
        self.stated: set[Prefix] = set()  # listed states whose KV memory held whole when they were listed

    def attached(self, obs):
        for key in MEMORY_COUNTERS:
            self.coverage.setdefault(key, 0)

    # -- a prompt arrives --------------------------------------------------------------------
    def submitted(self, obs, ev):
        if obs.probing:
            return
        prompt, B = ev.request.prompt, obs.layout.block_size
        held = Held(obs.memory)
        if prompt in self.finished_held and held.reuse(prompt) < self.finished_held[prompt]:
            self.count("aba_displaced")
        self.count("divergences_inside_held_block", held.diverges_inside_a_block(prompt, B))
        self.count("mid_block_reuse_held", held.reuse(prompt) % B != 0)
        view = obs.last_view
        if view is not None:
            index = INDEXES.get(view, B)
            self.local[ev.request.request_id] = index.best_reuse(prompt)
            deepest = max((p for p in range(1, len(prompt)) if prompt[:p] in index.states), default=0)
            kv_len = held.kv_len(prompt)
            self.count("state_outlives_kv", deepest > kv_len)
            self.count("state_outlives_held_kv", deepest > kv_len > 0)
        else:
            self.local[ev.request.request_id] = 0

    # -- a plan, before it runs --------------------------------------------------------------
    def scheduled(self, obs, ev):
        if obs.probing:
            self.before = None
            return
        plan, B, mem = ev.plan, obs.layout.block_size, obs.memory
        tracks = obs.tracks
        conv = mem.conv.shape[2] + 1  # the conv window (memory keeps its last conv_width - 1 inputs)
        ops = obs.history.ops
        budget = getattr(ops[-1], "budget", None) if ops else None  # the step's token budget (Step, Drain)
        for rs in plan.requests:
            track = tracks[rs.request_id]
            self.tables[rs.request_id] = rs.block_table
            if track.computed is not None:
                continue
            self.first_start[rs.request_id] = rs.start
            if rs.start % B and rs.end % B and rs.end < track.prompt_len:
                self.count("mid_block_chunks_after_mid_block_hit")
            if rs.start > 0 and rs.state_init.kind != "fresh" and rs.end - rs.start < conv - 1:
                self.count("short_chunks_from_snapshot")
            elif rs.start > 0 and rs.state_init.kind != "fresh" and budget is not None \
                    and budget < conv - 1 < track.prompt_len - rs.start:
                self.count("short_chunks_rounded_up")  # asked for a short chunk, the cache computed more
            for b in rs.block_table[: -(-rs.start // B)]:  # what the hit reads is used now
                if 0 <= b < len(mem.kv_prov):
                    last = mem.kv_prov[b][B - 1]
                    if last is not None and (b, last) in self.last_use:
                        self.last_use[(b, last)] = obs.step_no
        view = obs.last_view
        if view is None:
            self.before = None
            return
        listed_kv = {e.block: e.tokens for e in view.cached_kv if e.tokens and 0 <= e.block < len(mem.kv_prov)}
        listed_states = {e.slot: e.tokens for e in view.cached_states if 0 <= e.slot < len(mem.conv_prov)}
        running = [r for r in obs.active() if tracks[r].computed is not None]
        holders: dict[Prefix, int] = {}
        for row in mem.kv_prov:
            last = row[B - 1]
            if last is not None:
                holders[last] = holders.get(last, 0) + 1
        in_use = []  # listed full-block entries a running request reads, held by no other block
        for r in running:
            seq = tracks[r].tokens
            for i, b in enumerate(self.tables.get(r, ())):
                tokens = listed_kv.get(b)
                if tokens is not None and len(tokens) == (i + 1) * B and seq[: len(tokens)] == tokens \
                        and holders.get(tokens) == 1:
                    in_use.append((b, tokens))
        self.before = (listed_kv, listed_states, running, in_use)

    # -- memory at rest ----------------------------------------------------------------------
    def settled(self, obs, ev):
        if obs.probing:
            return
        mem, B = obs.memory, obs.layout.block_size
        if self.before is not None:
            listed_kv, listed_states, running, in_use = self.before
            self.before = None
            gone_kv = [(b, t) for b, t in listed_kv.items() if mem.kv_prov[b][(len(t) - 1) % B] != t]
            gone_states = [s for s, t in listed_states.items() if mem.conv_prov[s] != t or mem.ssm_prov[s] != t]
            # KV the cache listed at any earlier view and memory still held until now: a cache that
            # stops listing an entry when it frees it (SGLang) and writes it in a later step overwrites
            # cached content all the same (its page 4 under kv-scarce: none listed at the schedule)
            earlier = [x for x in self.last_use if x not in listed_kv.items()
                       and mem.kv_prov[x[0]][(len(x[1]) - 1) % B] != x[1]]
            if (gone_kv or gone_states or earlier) and running:
                self.count("cached_overwritten_while_running")
            for x in earlier:
                self.last_use.pop(x, None)
            kept = [(b, t) for b, t in in_use if mem.kv_prov[b][B - 1] == t]
            if gone_kv and kept and any(self.last_use.get(x, 0) >= self.last_use.get(e, 0)
                                        for x in gone_kv for e in kept):
                self.count("evictions_past_running_entry")
            for x in gone_kv:
                self.last_use.pop(x, None)
            kv_lost = bool(gone_kv)
        else:
            kv_lost = True  # nothing to compare with: look
        for e in ev.view.cached_kv:
            if e.tokens:
                self.last_use.setdefault((e.block, e.tokens), obs.step_no)
        self._states_and_their_kv(mem, ev.view, B, kv_lost)
        # what memory could serve each prompt whose request just finished
        for rid, t in obs.tracks.items():
            if t.done and rid not in self.seen_done:
                self.seen_done.add(rid)
                if t.generated > 0:
                    # the prompt, and the prompt with its first output token (what a prompt-end state
                    # serves: a request asks for it again as the next turn of its conversation)
                    held = Held(mem)
                    for asked in (t.tokens[: t.prompt_len], t.tokens[: t.prompt_len + 1]):
                        self.finished_held[asked] = held.reuse(asked)

    def _states_and_their_kv(self, mem, view, B: int, kv_lost: bool) -> None:
        """``states_gone_with_kv``: of the states listed with their KV whole
        in memory, those whose KV memory lost, and which were not listed any
        more by then (each counted once, when its KV goes)."""
        listed = {e.tokens for e in view.cached_states if e.tokens}
        new = listed - self.stated
        if not new and not (kv_lost and self.stated):
            return
        held = Held(mem)
        if kv_lost:  # (only then can a tracked state's KV have gone: most steps overwrite no listed KV)
            for prefix in [p for p in self.stated if not held.kv_whole(p, B)]:
                self.stated.discard(prefix)
                self.count("states_gone_with_kv", prefix not in listed)
        self.stated.update(p for p in new if held.kv_whole(p, B))

    def computed(self, obs, executed):
        rs = executed.step
        if obs.probing or obs.tracks[rs.request_id].computed is not None or not executed.loads_read:
            return
        local = self.local.get(rs.request_id, 0)
        if 0 < local < rs.start:
            self.count("tier_hits_over_local")
            self.count("tier_hits_over_mid_block_local", local % obs.layout.block_size != 0)

    def aborted(self, obs, ev):
        rid = ev.request_id
        track, B = obs.tracks[rid], obs.layout.block_size
        p = self.first_start.get(rid)
        if obs.probing or track.computed is None or p is None or p % B == 0:
            return
        end = (p // B + 1) * B
        if not track.computed < min(end, track.prompt_len):
            return
        table = self.tables.get(rid, ())
        if p // B >= len(table):
            return
        row = obs.memory.kv_prov[table[p // B]]
        if row[p % B - 1] == track.tokens[:p] and row[B - 1] != track.tokens[:end]:
            self.count("aborts_before_copied_block_complete")
