"""Coverage of the histories outside caches needed and the generator never
built (issue 37), counted from memory and provenance, the harness's record
of each request (tracks, the tables its plans gave, the verifications the
oracle decided), never from what the implementation says of itself.

- ``evictions_past_live_hit``: a step overwrote a listed KV entry that was
  listed after a block a running request reads through its prefix hit (a
  block it did not write, in its table since its first step, held by memory
  and by no other block): an order by age that forgot the hit's reference
  (a hit that took a cached block without removing it from its free queue)
  would have taken the hit's block first (a);
- ``reconverged_blocks``: a prompt arrives with a full block whose tokens
  memory holds at the same block index after another prefix (the prompts
  parted before it and continue with the same content): a cache keyed by a
  block's tokens alone, or by its last block, confuses the two (b);
  ``relocated_blocks``: a prompt's full block whose tokens memory holds only
  at another block index (a key that ignores the position) (b);
- ``drafts_past_remaining``: a verification of at least as many drafts as
  the tokens its request may still generate (engines draft up to ``k``
  whatever ``max_tokens`` leaves); ``ends_in_verification``: a request that
  finished in a step that verified drafts and kept fewer than it verified
  (rejected, or past its last token): its sequence ends inside the
  verification (c);
- ``verify_below_declared``: a verification of fewer drafts than declared
  (a drafter that proposes fewer, as vLLM's ngram does) (d);
  ``rejected_drafts_opened_block``: a verification in which a block's first
  position was a discarded draft's: a block opened only by drafts that were
  not kept (d, h);
- ``aborts_after_verify``: an abort of a request that verified drafts at
  least once (e);
- ``admissions_beside_verify``: a request's first step in a step whose
  plan also verifies another request's drafts that complete a block, the
  new prompt sharing that request's tokens and drafts through the block (f);
- ``waits_while_busy``: a request whose first step came after a step that
  computed others since it was submitted (it waited for room);
  ``evicted_while_waiting``: the same, where memory lost part of the KV
  prefix of its prompt it held at submission before its first step (g);
- ``aborts_after_copy_before_first_step``: an abort of a request that has
  not computed yet, after a step whose block copies wrote a block holding a
  prefix of its prompt that ends inside the block (a copy-on-write for its
  hit), memory still holding it (h); ``hit_chunks_to_block_end``: a first
  chunk after a hit ending inside a block that stops before the prompt's
  end, on that block's end (the chances of a design that runs it there:
  ``judge/coverage.py``'s waivers).
- ``finished_blocks_retaken``: a step writes a KV block that, when the step
  before ended, held the KV of a request that finished in it: what an
  asynchronous second tier still had to read of that request, unless it
  waited, is overwritten (``turn-over``, :mod:`conformance.generate.rules.turnover`).

The pool probe's requests (``obs.probing``) are not counted.
"""

from __future__ import annotations

from conformance.harness.checker import Checker

Prefix = tuple[int, ...]

REACH_COUNTERS = ("evictions_past_live_hit", "reconverged_blocks", "relocated_blocks", "drafts_past_remaining",
                  "ends_in_verification", "verify_below_declared", "rejected_drafts_opened_block",
                  "aborts_after_verify", "admissions_beside_verify", "waits_while_busy", "evicted_while_waiting",
                  "aborts_after_copy_before_first_step", "hit_chunks_to_block_end", "finished_blocks_retaken")


def _kv_len(memory, prompt: Prefix) -> int:
    """Longest n such that memory holds the KV of every position of ``prompt[:n]`` (by provenance)."""
    B = memory.layout.block_size
    rows: dict[int, set[Prefix]] = {}
    for row in memory.kv_prov:
        for off, p in enumerate(row):
            if p is not None:
                rows.setdefault(off, set()).add(p)
    n = 0
    while n < len(prompt) and prompt[: n + 1] in rows.get(n % B, ()):
        n += 1
    return n


def _copied_for(row, prompt: Prefix, B: int) -> bool:
    """A block's row holds a prefix of ``prompt`` that ends inside the block
    and before the prompt's end (a copy-on-write for a hit there)."""
    return any(p is not None and len(p) % B and len(p) < len(prompt) and prompt[: len(p)] == p for p in row)


class ReachCoverage(Checker):
    name = "reach-coverage"

    def __init__(self):
        super().__init__()
        self.tables: dict[str, tuple[int, ...]] = {}
        self.hits: dict[str, list[tuple[int, Prefix]]] = {}  # request -> (block, content) its hit read
        self.listed_at: dict[tuple[int, Prefix], int] = {}  # listed KV entry -> the step it was first listed
        self.before: tuple | None = None  # (listed KV, live hit blocks with their listing step) at the schedule
        self.verified: set[str] = set()  # requests that verified drafts
        self.waiting: dict[str, list] = {}  # request -> [KV held at submission, steps waited, lost]
        self.copied: dict[str, int] = {}  # unscheduled request -> a copied mid-block prefix of it
        self.finished_kv: dict[int, tuple] = {}  # block -> its row, of requests the step before finished

    def attached(self, obs):
        for key in REACH_COUNTERS:
            self.coverage.setdefault(key, 0)

    # -- a prompt arrives --------------------------------------------------------------------
    def submitted(self, obs, ev):
        if obs.probing:
            return
        prompt, mem = ev.request.prompt, obs.memory
        B = obs.layout.block_size
        held: dict[Prefix, set[int]] = {}  # a full block's tokens -> block indexes memory holds them at
        whole: set[Prefix] = set()
        for row in mem.kv_prov:
            last = row[B - 1]
            if last is not None and len(last) % B == 0:
                held.setdefault(last[-B:], set()).add(len(last) // B - 1)
                whole.add(last)
        reconverged = relocated = False
        for i in range(len(prompt) // B):
            block = prompt[i * B: (i + 1) * B]
            where = held.get(block)
            if not where:
                continue
            if i in where and i > 0 and prompt[: (i + 1) * B] not in whole:
                reconverged = True  # the same content at the same place, after another prefix
            if i not in where:
                relocated = True
        self.count("reconverged_blocks", reconverged)
        self.count("relocated_blocks", relocated)
        self.waiting[ev.request.request_id] = [_kv_len(mem, prompt), 0, False]

    # -- a plan, before it runs --------------------------------------------------------------
    def scheduled(self, obs, ev):
        if obs.probing:
            self.before = None
            return
        plan, mem, tracks = ev.plan, obs.memory, obs.tracks
        B = obs.layout.block_size
        declared = obs.speculation
        verifying = [rs for rs in plan.requests if rs.drafts]
        for rs in plan.requests:
            track = tracks[rs.request_id]
            self.tables[rs.request_id] = rs.block_table
            if rs.drafts:
                self.count("drafts_past_remaining", len(rs.drafts) >= track.max_new - track.generated)
                self.count("verify_below_declared", declared is not None and len(rs.drafts) < declared.max_drafts)
            if track.computed is not None:
                continue
            self.copied.pop(rs.request_id, None)
            # a first chunk after a mid-block hit that stops before the prompt's end, on the block's end
            self.count("hit_chunks_to_block_end", rs.start % B != 0 and rs.end % B == 0 and rs.end < track.prompt_len)
            wait = self.waiting.pop(rs.request_id, None)
            if wait is not None and wait[1] > 0:
                self.count("waits_while_busy")
                self.count("evicted_while_waiting", wait[2])
            if rs.start >= B:  # the full blocks its hit reads, as memory holds them now
                self.hits[rs.request_id] = [(b, mem.kv_prov[b][B - 1]) for b in rs.block_table[: rs.start // B]
                                            if 0 <= b < len(mem.kv_prov) and mem.kv_prov[b][B - 1] is not None]
            for v in verifying:  # a new prompt beside a verification that completes a block it shares
                seq = tracks[v.request_id].tokens + tuple(v.drafts)
                q = (v.end // B + 1) * B  # the block the drafts complete ends there
                if v.request_id != rs.request_id and q <= v.end + len(v.drafts) and track.tokens[:q] == seq[:q]:
                    self.count("admissions_beside_verify")
                    break
        if self.finished_kv:
            written = {b for rs in plan.requests for b in rs.block_table[rs.start // B: -(-rs.end // B)]}
            self.count("finished_blocks_retaken", any(b in written and tuple(mem.kv_prov[b]) == row
                                                      for b, row in self.finished_kv.items()))
            self.finished_kv = {}
        scheduled = {rs.request_id for rs in plan.requests}
        for rid, wait in self.waiting.items():  # a step that computes others while it waits
            if plan.requests and rid not in scheduled and rid in tracks and not tracks[rid].done:
                wait[1] += 1
        self.before = None
        view = obs.last_view
        if view is None or not any(self.hits.get(rid) for rid in obs.active()):
            return
        listed = {(e.block, e.tokens) for e in view.cached_kv if e.tokens and 0 <= e.block < len(mem.kv_prov)}
        holders: dict[Prefix, int] = {}
        for row in mem.kv_prov:
            if row[B - 1] is not None:
                holders[row[B - 1]] = holders.get(row[B - 1], 0) + 1
        live = []  # hit blocks running requests read, held by memory and no other block, with their age
        for rid in obs.active():
            table = self.tables.get(rid, ())
            for b, content in self.hits.get(rid, ()):
                if b in table and mem.kv_prov[b][B - 1] == content and holders.get(content) == 1 \
                        and (b, content) in self.listed_at:
                    live.append((b, content, self.listed_at[(b, content)]))
        if live:
            self.before = (listed, live)

    def stepped(self, obs, record):
        if obs.probing:
            return
        B = obs.layout.block_size
        self.finished_kv = {}
        for rid in record.finished:  # the blocks its table gave it that hold its KV now
            tokens = obs.tracks[rid].tokens if rid in obs.tracks else ()
            for b in self.tables.get(rid, ()):
                row = obs.memory.kv_prov[b] if 0 <= b < len(obs.memory.kv_prov) else None
                if row and any(p is not None and tokens[: len(p)] == p for p in row):
                    self.finished_kv[b] = tuple(row)
        for v in obs.history.verified_this_step().values():
            self.verified.add(v.request_id)
            if v.request_id in record.finished and v.accepted < len(v.drafts):
                self.count("ends_in_verification")
            # positions end + j for j > accepted were drafts not kept (end + accepted takes the sampled token)
            self.count("rejected_drafts_opened_block",
                       any((v.end + j) % B == 0 for j in range(v.accepted + 1, len(v.drafts))))
        if record.plan.kv_copies and self.waiting:
            mem = obs.memory
            for rid in list(self.waiting):
                track = obs.tracks.get(rid)
                if track is None or track.done or track.computed is not None:
                    continue
                prompt = track.tokens[: track.prompt_len]
                for _, dst in record.plan.kv_copies:
                    if 0 <= dst < len(mem.kv_prov) and _copied_for(mem.kv_prov[dst], prompt, B):
                        self.copied[rid] = dst

    # -- memory at rest ----------------------------------------------------------------------
    def settled(self, obs, ev):
        if obs.probing:
            return
        mem, B = obs.memory, obs.layout.block_size
        if self.before is not None:
            listed, live = self.before
            self.before = None
            gone = [(b, t) for b, t in listed if mem.kv_prov[b][(len(t) - 1) % B] != t]
            kept = [(b, c, at) for b, c, at in live if mem.kv_prov[b][B - 1] == c]
            if gone and kept and any(self.listed_at.get(x, 0) > at for x in gone for _, _, at in kept):
                self.count("evictions_past_live_hit")
            for x in gone:
                self.listed_at.pop(x, None)
        for e in ev.view.cached_kv:
            if e.tokens:
                self.listed_at.setdefault((e.block, e.tokens), obs.step_no)
        for rid, wait in self.waiting.items():
            track = obs.tracks.get(rid)
            if wait[1] and not wait[2] and wait[0] and track is not None and not track.done:
                wait[2] = _kv_len(mem, track.tokens[: track.prompt_len]) < wait[0]

    def aborted(self, obs, ev):
        if obs.probing:
            return
        rid = ev.request_id
        self.count("aborts_after_verify", rid in self.verified)
        self.waiting.pop(rid, None)
        dst = self.copied.pop(rid, None)
        if dst is not None and obs.tracks[rid].computed is None:
            self.count("aborts_after_copy_before_first_step",
                       _copied_for(obs.memory.kv_prov[dst], obs.tracks[rid].tokens, obs.layout.block_size))
