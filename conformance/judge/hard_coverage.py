"""Coverage of the hard histories (issue 14) and of the transfer decisions:
counted from what the session recorded (tracks, plans, the harness's own
transfer controller), never from what the implementation says, except
evictions, which the session measures from views memory proved honest.

- ``evictions_while_running``: entries evicted in a step in which some
  request was mid-prefill or mid-decode;
- ``same_step_cold_prefills``: one step in which two or more requests start
  cold (at 0) on the same first block;
- ``aba_rerequests``: a prompt asked for again (or with one token more, as
  its next turn) after evictions displaced what was cached when it was
  first asked for;
- ``in_block_divergences`` / ``tail_divergences``: a prompt whose longest
  common prefix with an earlier sequence ends inside a block (and, for the
  second, one token into the partial last block of a sequence it shares
  that prefix with: any of them, not the first found);
- ``matched_then_evicted``: a waiting request whose cached prefix (KV) was
  shorter at a later schedule than at an earlier one: the LRU met an entry
  between its match and its use;
- ``snapshot_hits_under_slot_pressure``: a hit from a cached snapshot
  (copied, or resumed from a slot the plan's state copies filled) in a
  step where at most one state slot is free: unreferenced, holding no cached
  entry (a new snapshot there evicts nothing) and untouched by the step's
  plan (the view's word that a slot the step writes or reads is free is not
  taken).  Where one pool serves KV and states (vLLM), the view states
  state-slot refcounts only for ids the KV group does not own, so a page that
  holds cached KV is not counted free; ``snapshot_hits_unmeasured``: such a
  hit under a view that states no state refcounts (optional in the
  contract): nothing tells a free slot there;
- ``aborts_mid_prefill``, ``aborts_mid_decode``,
  ``aborts_mid_prefill_after_mid_block_hit``: aborts of requests that ran;
- ``loads_broken`` (failed or short), ``loads_held``, ``loads_delayed``, ``loads_failed``, ``loads_short``,
  ``loads_reordered``, ``store_evicted_during_load``, ``claims_while_loading``,
  ``aborts_while_loading``: the transfer decisions that acted;
- ``mid_block_local_vs_remote``: a prompt submitted when the longest prefix
  the device could reuse for it ends inside a block and the host store (with
  the device) holds a longer one up to a block boundary: the tiers' fourth
  reconciliation case, where a cache holds a block for the local tail while
  it compares.
"""

from __future__ import annotations

from conformance.harness.checker import Checker
from conformance.judge.expected_hit import StoreIndex, longest_held
from conformance.judge.reuse import INDEXES

HARD_COUNTERS = ("evictions_while_running", "same_step_cold_prefills", "aba_rerequests", "in_block_divergences",
                 "tail_divergences", "matched_then_evicted", "snapshot_hits_under_slot_pressure",
                 "snapshot_hits_unmeasured",
                 "aborts_mid_prefill", "aborts_mid_decode", "aborts_mid_prefill_after_mid_block_hit")
TRANSFER_COUNTERS = ("loads_broken", "loads_held", "loads_delayed", "loads_failed", "loads_short", "loads_reordered",
                     "store_evicted_during_load", "claims_while_loading", "aborts_while_loading",
                     "mid_block_local_vs_remote")
_CONTROL = {"held": "loads_held", "delayed": "loads_delayed", "failed": "loads_failed", "short": "loads_short",
            "reordered": "loads_reordered", "store_evicted": "store_evicted_during_load"}


class HardHistoryCoverage(Checker):
    name = "hard-coverage"

    def __init__(self):
        super().__init__()
        self.first_start: dict[str, int] = {}  # request -> where its first step started
        self.asked: dict[tuple[int, ...], int] = {}  # prompt -> evictions counted when it was last asked for
        self.waiting_kv: dict[str, int] = {}  # request -> KV servable at the last schedule, before its first step
        self.evictions = 0

    def attached(self, obs):
        for key in HARD_COUNTERS + TRANSFER_COUNTERS:
            self.coverage.setdefault(key, 0)

    def submitted(self, obs, ev):
        if obs.probing:  # the pool probe's requests are the harness's, not the check's situations
            return
        request = ev.request
        B, prompt = obs.layout.block_size, request.prompt
        evicted = obs.evicted
        # asked for again, or as its next turn (one token more: under prompt-end retention the
        # state at the prompt's end serves only that)
        again = prompt if prompt in self.asked else prompt[:-1]
        if again in self.asked and evicted > self.asked[again]:
            self.count("aba_rerequests")
        self.asked[prompt] = evicted
        best, tail = 0, False
        for rid, t in obs.tracks.items():
            if rid == request.request_id:
                continue
            seq, n = t.tokens, 0
            limit = min(len(seq), len(prompt))
            while n < limit and seq[n] == prompt[n]:
                n += 1
            if n < limit and n >= best:
                # one token into the partial tail of any sequence it shares its longest prefix with
                here = len(seq) % B != 0 and n == len(seq) // B * B + 1
                best, tail = n, here or (tail and n == best)
        if best % B:
            self.count("in_block_divergences")
            self.count("tail_divergences", tail)
        self.waiting_kv[request.request_id] = -1
        pending = {t.request_id for t in obs.pending_loads()}
        loading = [obs.tracks[r].tokens[:B] for r in pending if r in obs.tracks and r != request.request_id]
        self.count("claims_while_loading", any(prompt[:B] == p for p in loading))
        self.count("mid_block_local_vs_remote", self._tail_against_boundary(obs, prompt))

    @staticmethod
    def _tail_against_boundary(obs, prompt) -> bool:
        """The device's best reuse for ``prompt`` ends inside a block, and a
        longer prefix up to a block boundary is held whole by the host store
        and the device together, as the last view and the store's provenance
        say (the expected-hit oracle's measure of the tiers)."""
        store, B = obs.store, obs.layout.block_size
        if not store.entries or obs.last_view is None:
            return False
        here = INDEXES.get(obs.last_view, B)
        local = here.best_reuse(prompt)
        return local % B != 0 and longest_held(prompt, here, StoreIndex(store, B), B, B) > local

    def scheduled(self, obs, ev):
        if obs.probing:
            return
        plan, view = ev.plan, ev.view
        B = obs.layout.block_size
        cold: dict[tuple[int, ...], int] = {}
        touched = {slot for rs in plan.requests for slot in (rs.state_slot, rs.state_init.source,
                                                             *(s for _, s in rs.snapshots))}
        touched |= {s for pair in plan.state_copies for s in pair}
        for rs in plan.requests:
            track = obs.tracks[rs.request_id]
            if track.computed is not None:
                continue
            self.first_start[rs.request_id] = rs.start
            self.waiting_kv.pop(rs.request_id, None)
            if rs.start == 0 and track.prompt_len > B:
                cold[track.tokens[:B]] = cold.get(track.tokens[:B], 0) + 1
            if rs.state_init.kind != "fresh" and rs.start > 0 and view is not None:
                if not view.state_refcounts:  # free is a refcount notion: a view without them cannot say
                    self.count("snapshot_hits_unmeasured")
                    continue
                # slots neither referenced nor holding a cached snapshot: what a new snapshot can take
                cached = {e.slot for e in view.cached_states}
                free = sum(1 for s, r in view.state_refcounts.items() if r == 0 and s not in cached | touched)
                self.count("snapshot_hits_under_slot_pressure", free <= 1)
        self.count("same_step_cold_prefills", sum(1 for n in cold.values() if n >= 2))
        # waiting requests: did what they could reuse shrink since the last schedule?
        if self.waiting_kv and view is not None:
            index = INDEXES.get(view, B)
            for rid in list(self.waiting_kv):
                track = obs.tracks.get(rid)
                if track is None or track.done:
                    self.waiting_kv.pop(rid, None)
                    continue
                kv = index.kv_servable(track.tokens[: track.prompt_len])
                self.count("matched_then_evicted", 0 < kv < self.waiting_kv[rid])
                self.waiting_kv[rid] = kv

    def settled(self, obs, ev):
        evicted = obs.evicted
        if evicted > self.evictions and any(obs.tracks[r].computed is not None for r in obs.active()):
            self.count("evictions_while_running")
        self.evictions = evicted
        decided = obs.transfer_decisions
        if decided is not None:
            for name, key in _CONTROL.items():
                self.coverage[key] = decided[name]
            self.coverage["loads_broken"] = decided["failed"] + decided["short"]

    def aborted(self, obs, ev):
        request_id = ev.request_id
        track = obs.tracks[request_id]
        if any(t.request_id == request_id for t in obs.pending_loads()):
            self.count("aborts_while_loading")
        if track.computed is None:
            return
        if track.computed < track.prompt_len:
            self.count("aborts_mid_prefill")
            self.count("aborts_mid_prefill_after_mid_block_hit",
                       self.first_start.get(request_id, 0) % obs.layout.block_size != 0)
        else:
            self.count("aborts_mid_decode")
