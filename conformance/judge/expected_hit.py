"""The expected-hit oracle: at each admission, the longest prefix a correct
implementation could reuse, computed from what the harness knows is held.

- **Local**: the KV and the recurrent state the device holds (the
  implementation's view, which memory with provenance proved honest every
  step), the least over every ``schedule()`` between the request's submission
  and its first step (:class:`~conformance.judge.reuse.LookupWindow`: what
  was evicted or registered meanwhile cannot be held for or against it),
  schedules whose plan computed nothing included: those are where a request
  waits for its own loads, and what its loads bring in is the remote part's,
  not a local hit it had when it was matched.
- **Remote**: what the harness's host store holds, read by provenance (never
  by the implementation's keys): the longest multiple p of the declared tier
  unit (``retention()["tier_unit"]``, a block by default) below the prompt's
  length such that every block of ``prompt[:p]`` is on the device or in the
  store whole, and the state after ``prompt[:p]`` is on the device or in the
  store whole.  "On the device" is what the views before and after the
  ``schedule()`` both list as the same entry (the same block or slot under
  the same prefix, :class:`~conformance.judge.reuse.HeldAcross`): a cache that
  registers the blocks a plan is about to compute when it schedules them
  (vLLM caches them at allocation) lists, after that schedule, content not
  written yet, for the very request being judged, possibly under a prefix an
  entry the same schedule evicted held before it.  Also the least over the window (an entry
  whose offload was still in flight at one of its schedules was held nowhere
  then).

The expectation is the longer of the two, compared in tokens (a local hit
that ends inside a block counts every token); an implementation that
declares ``retention()["tier_over_local"] = False`` (its host tier serves
only a prompt the device has no hit for, never a longer prefix over a local
hit) is expected the local hit wherever there is one.  Two verdicts:

- a first step that starts *before* the expectation is a ``hit-rate`` failure
  (a performance bug: the logits stay right);
- a first step that starts on more than memory held when it ran (its KV or
  its state did not describe ``prompt[:start]``) is a correctness failure
  (``invariant``), whatever the logits say.

The coverage counter ``remote_expected`` counts the admissions whose
expectation only the host tier could meet (remote longer than local);
``remote_excused`` those the host tier would have decided had a load of the
request not come back broken (below): where environment faults break most
transfers, the second is what a run under them can reach.

The remote part is excused, not failed, where a correct implementation could
not have reused it, and only there:

- a load of the request came back failed, missing, or with bytes other
  than the entry's source bytes (short, corrupted, another entry's; broken
  on the wire, or a copy its offload broke: the transport marks each
  completed load ``intact`` or not): a correct cache may give a request one
  round of loads (so that a failing tier cannot starve it) and recompute.
  The host copy such a load read is not counted for any later request
  either (a correct cache may stop trusting a copy that once came back bad),
  but a later offload under the same key is a new copy, and held.  A copy
  whose offload broke it (``HostEntry.intact`` false) is held for no one:
  no load of it can verify.  A load that only completes late is not broken;
- the device had no room to bring it in at one of the request's schedules
  (:meth:`ExpectedHit._room`): destinations for the blocks and the state the
  device lacks, plus a block and a slot for the request itself, out of the
  unreferenced blocks and slots (cached ones count: a correct cache evicts
  them to make room) less the device's entries the load joins, plus what the
  request itself holds in that schedule (its load destinations, or what its
  first step allocated instead of loading).  Room taken by *other* requests
  (their loads, their steps) is rightly no room.

An implementation that declares no tier unit is held to the local part only.

Speculative decoding: an implementation that declares a hit drop
(``Speculation.hit_drop``: EAGLE and MTP give the last block of a hit back, for
the drafter to recompute) is expected a reuse that much shorter, in both
parts: the longest prefix with a state at most the KV hit less the drop.  What
verification steps cached counts like anything else the view lists (memory
proved it), and a rejected draft's content never does
(:mod:`conformance.judge.spec_decode`).
"""

from __future__ import annotations

from collections.abc import Mapping

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker
from conformance.harness.history import TransferCompleted
from conformance.judge.retention import declared_retention
from conformance.judge.reuse import HeldAcross, LookupWindow

Prefix = tuple[int, ...]


class StoreIndex:
    """The host store's whole entries, by the prefix their provenance names."""

    def __init__(self, store, block_size: int, distrusted: Mapping[str, object] | None = None):
        self.kv: set[Prefix] = set()  # prefixes whose last full block an entry holds (full attention layers)
        self.win: dict[int, set[Prefix]] = {}  # the same for each window group's layers
        self.states: set[Prefix] = set()
        for key, entry in store.entries.items():
            if not getattr(entry, "intact", True):  # its bytes broke on the way in: no load of it verifies
                continue
            if distrusted and distrusted.get(key) is entry:  # the very copy a broken load read
                continue
            prov = entry.payload.prov
            if entry.payload.kind == "kv":
                cells = prov.get("kv") or []
                if len(cells) == block_size and all(c is not None for c in cells):
                    last = cells[-1]
                    if all(c == last[: len(last) - block_size + 1 + i] for i, c in enumerate(cells)):
                        group = getattr(entry, "window_group", None)
                        (self.kv if group is None else self.win.setdefault(group, set())).add(last)
            elif prov.get("conv") is not None and prov.get("conv") == prov.get("ssm"):
                self.states.add(prov["ssm"])


def longest_held(prompt: Prefix, here, there: StoreIndex, B: int, unit: int) -> int:
    """The longest multiple p of ``unit`` below the prompt's length such that
    every block of ``prompt[:p]`` is whole on the device (``here``, an index of
    a view) or in the host store (``there``), the state after ``prompt[:p]``
    is in either, and so is every window group's KV that a step resuming at p
    reads (``here.windows``: [p - W + 1, p) for a window W): what the two tiers
    together hold for it."""
    best, k = 0, 0
    while (k + 1) * B < len(prompt):
        full = prompt[: (k + 1) * B]
        if full not in there.kv and full not in here.kv_by_block.get(k, ()):
            break
        k += 1
        p = k * B
        if p % unit == 0 and (prompt[:p] in there.states or prompt[:p] in here.states) \
                and here.windows_held(prompt, p, there):
            best = p
    return best


class ExpectedHit(Checker):
    name = "expected-hit"

    def __init__(self):
        super().__init__()
        self.decl: dict | None = None
        self.window = LookupWindow()
        self.remote_floor: dict[str, int] = {}  # waiting request -> least remote reuse seen
        self.excused: set[str | None] = set()  # requests whose remote reuse a correct cache could not have had
        self.seen_events = 0
        # host key -> the copy a load of which broke (a cache may stop trusting
        # that copy; a later offload under the same key is a new copy)
        self.distrusted: dict[str, object] = {}
        self.hit_drop = 0  # Speculation.hit_drop, read when attached

    def attached(self, obs) -> None:
        self.decl = declared_retention(obs)
        self.unit = (self.decl or {}).get("tier_unit") or obs.layout.block_size
        # Speculative decoding: a cache that drops the last block of a hit for
        # its drafter (EAGLE / MTP, declared) is expected that much less.
        declared = obs.speculation
        self.hit_drop = declared.hit_drop if declared is not None else 0
        self.window.hit_drop = self.hit_drop

    # -- the remote tier ------------------------------------------------------------------
    def _remote(self, obs, rid: str, prompt: Prefix, view, plan) -> int:
        B, unit = obs.layout.block_size, self.unit
        store = obs.store
        if not store.entries:
            return 0
        before = obs.last_view
        # what the device held across the schedule: the same entries in the views before and after it
        here = HeldAcross(before, view, B, obs.memory.windows)
        there = StoreIndex(store, B, self.distrusted)
        best = longest_held(prompt, here, there, B, unit)
        if best and self.hit_drop:  # what the drafter's drop leaves of it: a held prefix that much shorter
            best = longest_held(prompt[: max(0, best - self.hit_drop) + 1], here, there, B, unit)
        if best and view is not None and view.kv_refcounts and not self._room(obs, rid, prompt[:best], view,
                                                                              before, here, plan):
            return -1  # no room to bring it in: excused
        return best

    @staticmethod
    def _room(obs, rid: str, held: Prefix, view, before, here, plan) -> bool:
        """Whether a correct cache had the room to bring ``held`` in when it
        matched the request: a destination for each block and for the state
        the device lacks, and a block and a slot more for the request itself
        (its next block, or the copy of a local tail the comparison holds; its
        running state).  Out of what it can take: every unreferenced block and
        slot (cached ones are what a cache evicts to make room) that the step
        does not use for another request or a copy (a copy source stated at 0
        is still read by the step: no room, whatever the view says), less the
        device's own entries of ``held`` (a load joins them: they are pinned,
        not evicted), plus what the request itself took in this schedule or
        holds for its loads (the view after schedule() shows them taken, by
        the very request the room was for: the destinations of its loads, or
        the running slot and the fresh blocks at ``held``'s positions of a
        first step that reused less: what it allocated instead of loading,
        even where the cache registered them at that schedule)."""
        B = obs.layout.block_size
        wanted = {held[: (k + 1) * B] for k in range(len(held) // B)}
        # entries the view before the schedule listed too (see HeldAcross)
        kept_kv = {(e.block, e.tokens) for e in before.cached_kv} if before is not None else set()
        kept_state = {(e.slot, e.tokens) for e in before.cached_states} if before is not None else set()
        cached_kv = {e.block for e in view.cached_kv if (e.block, e.tokens) in kept_kv}
        cached_state = {e.slot for e in view.cached_states if (e.slot, e.tokens) in kept_state}
        joined_kv = {e.block for e in view.cached_kv if e.tokens in wanted and e.block in cached_kv}
        joined_state = {e.slot for e in view.cached_states if e.tokens == held and e.slot in cached_state}
        to_load_kv = sum(1 for k in range(len(held) // B) if held[: (k + 1) * B] not in here.kv_by_block.get(k, ()))
        to_load_state = 0 if held in here.states else 1
        loads = [t for t in (*plan.transfers, *obs.pending_loads())
                 if t.direction == "load" and t.request_id == rid]
        own_kv = {t.device for t in loads if t.kind == "kv"}
        own_state = {t.device for t in loads if t.kind == "state"}
        busy_kv: set[int] = set()  # what the step's other requests and its copies use, whatever the view states
        busy_state: set[int] = set()
        for rs in plan.requests:
            if rs.request_id == rid:  # its first step (the blocks it computes into are not cached yet)
                own_kv.update(set(rs.block_table[: len(held) // B]) - cached_kv)
                own_state.update({rs.state_slot} - cached_state)
            else:
                busy_kv.update(rs.block_table)
                busy_state.update({rs.state_slot, rs.state_init.source, *(t for _, t in rs.snapshots),
                                   *rs.draft_slots})
        busy_kv.update(b for pair in plan.kv_copies for b in pair)
        busy_state.update(s for pair in plan.state_copies for s in pair)
        busy_kv -= own_kv
        busy_state -= own_state
        free_kv = sum(1 for b, r in view.kv_refcounts.items()
                      if (r == 0 and b not in joined_kv and b not in busy_kv) or (r > 0 and b in own_kv))
        free_state = sum(1 for s, r in view.state_refcounts.items()
                         if (r == 0 and s not in joined_state and s not in busy_state) or (r > 0 and s in own_state))
        return free_kv >= to_load_kv + 1 and free_state >= to_load_state + 1

    def _note_broken_loads(self, obs) -> None:
        """Requests whose loads came back broken (from the record: a load that
        failed, or whose bytes are not the entry's source bytes, whether the
        wire broke them, the store answered with other bytes or the copy
        itself broke at its offload), and the host copies those loads read.
        By what landed, not by which fault fired: a fault on an offload breaks
        the load that reads its copy back, and a late completion
        (``transfer-reorder``, a delayed ``Deliver``) breaks nothing."""
        history = obs.history
        store = obs.store
        for ev in history.since(self.seen_events):
            broken: tuple[str | None, str | None] | None = None
            if isinstance(ev, TransferCompleted) and (not ev.ok or ev.intact is False):
                broken = self._owner(history, ev.id)
            if broken is not None:
                rid, key = broken
                self.excused.add(rid)
                entry = store.entries.get(key) if key is not None else None
                if key is not None and entry is not None:  # an entry the store dropped is held by no one
                    self.distrusted[key] = entry
        self.seen_events = len(history.events)

    @staticmethod
    def _owner(history, transfer_id: int) -> tuple[str | None, str] | None:
        """The request and the host key of a load, from the plan that issued
        it (None for an offload: a failed offload broke no load)."""
        t = history.issued(transfer_id)
        return (t.request_id, t.key) if t is not None and t.direction == "load" else None

    # -- phases ---------------------------------------------------------------------------
    def scheduled(self, obs, ev) -> None:
        plan, view = ev.plan, ev.view
        if self.decl is None or obs.probing:  # held to no reuse (judge/retention.py, FAMILIES)
            return
        if not plan.requests:  # no step follows: the local window sees this schedule here
            self.window.look(obs, obs.last_view, view)
        if view is None or self.decl.get("tier_unit") is None:
            return
        # Loads broken since the last step the checkers saw (a step that only
        # completed transfers need not reach ``stepped``): not held for anyone.
        self._note_broken_loads(obs)
        waiting = [rid for rid, t in obs.tracks.items() if not t.done and t.computed is None]
        for rid in waiting:
            track = obs.tracks[rid]
            r = self._remote(obs, rid, track.tokens[: track.prompt_len], view, plan)
            self.remote_floor[rid] = min(self.remote_floor.get(rid, r), r)

    def computed(self, obs, executed) -> None:
        rs = executed.step
        track = obs.tracks[rs.request_id]
        if track.computed is not None or rs.start == 0:
            return
        # (harness/runner.py _init_state: the state, the full attention KV, then the window groups' reads, if any)
        reads, _, windows = executed.reads.partition("; windows: ")
        held = "conv ok" in reads and "matrix ok" in reads and reads.endswith("): ok") and windows in ("", "ok")
        if not held:
            raise ConformanceFailure("invariant", f"request {rs.request_id} reused {rs.start} tokens, more than "
                                                  f"memory held for it: {executed.reads}")

    def stepped(self, obs, record) -> None:
        if self.decl is None or obs.probing:
            return
        self._note_broken_loads(obs)
        floors = self.window.observe(obs, record.plan, record.view_before)
        for rid, (_kv, local) in floors.items():
            rs = next(r for r in record.plan.requests if r.request_id == rid)
            remote = self.remote_floor.pop(rid, 0)
            if rid in self.excused and remote > local:
                # the host tier would have decided it, but a load broke: the
                # situation an environment fault is about (coverage under faults)
                self.count("remote_excused")
            if rid in self.excused or remote < 0:
                remote = 0
            if local > 0 and self.decl.get("tier_over_local") is False:
                # declared: the host tier only serves a prompt the device has no hit for
                remote = 0
            expected = max(local, remote)
            self.count("expected_hits")
            if remote > local:
                self.count("remote_expected")
            if rs.start < expected:
                tier = "the host tier" if remote > local else "the device"
                raise ConformanceFailure("hit-rate", f"request {rid} reused {rs.start} tokens, but a correct cache "
                                                     f"could reuse {expected} (device {local}, host tier {remote}, "
                                                     f"compared in tokens; the longer is on {tier})")
