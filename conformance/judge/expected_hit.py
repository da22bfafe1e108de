"""The expected-hit oracle: at each admission, the longest prefix a correct
implementation could reuse, computed from what the harness knows is held.

- **Local**: the KV and the recurrent state the device holds (the
  implementation's view, which memory with provenance proved honest every
  step), the least over every ``schedule()`` between the request's submission
  and its first step (:class:`~conformance.judge.reuse.LookupWindow`: what
  was evicted or registered meanwhile cannot be held for or against it).
- **Remote**: what the harness's host store holds, read by provenance (never
  by the implementation's keys): the longest multiple p of the declared tier
  unit (``retention()["tier_unit"]``, a block by default) below the prompt's
  length such that every block of ``prompt[:p]`` is on the device or in the
  store whole, and the state after ``prompt[:p]`` is on the device or in the
  store whole.  Also the least over the window.

The expectation is the longer of the two, compared in tokens (a local hit
that ends inside a block counts every token).  Two verdicts:

- a first step that starts *before* the expectation is a ``hit-rate`` failure
  (a performance bug: the logits stay right);
- a first step that starts on more than memory held when it ran (its KV or
  its state did not describe ``prompt[:start]``) is a correctness failure
  (``invariant``), whatever the logits say.

The remote part is excused, not failed, where a correct implementation could
not have reused it: a load of the request that came back failed, short or
missing (a fault or a ``Deliver``/``StoreEvict`` decision fired on it; the
entries such a load read are not counted for any later request either: a
correct cache may stop trusting a host entry that once came back bad), or a
device without the room to bring it in (fewer unreferenced blocks than the
blocks to load plus one, or fewer than two unreferenced state slots).
An implementation that declares no tier unit is held to the local part only.
"""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker
from conformance.judge.retention import declared_retention
from conformance.judge.reuse import INDEXES, LookupWindow

Prefix = tuple[int, ...]


class StoreIndex:
    """The host store's whole entries, by the prefix their provenance names."""

    def __init__(self, store, block_size: int, distrusted: set[str] = frozenset()):
        self.kv: set[Prefix] = set()  # prefixes whose last full block an entry holds
        self.states: set[Prefix] = set()
        for key, entry in store.entries.items():
            if key in distrusted:
                continue
            prov = entry.payload.prov
            if entry.payload.kind == "kv":
                cells = prov.get("kv") or []
                if len(cells) == block_size and all(c is not None for c in cells):
                    last = cells[-1]
                    if all(c == last[: len(last) - block_size + 1 + i] for i, c in enumerate(cells)):
                        self.kv.add(last)
            elif prov.get("conv") is not None and prov.get("conv") == prov.get("ssm"):
                self.states.add(prov["ssm"])


def longest_held(prompt: Prefix, here, there: StoreIndex, B: int, unit: int) -> int:
    """The longest multiple p of ``unit`` below the prompt's length such that
    every block of ``prompt[:p]`` is whole on the device (``here``, an index of
    a view) or in the host store (``there``), and the state after
    ``prompt[:p]`` is in either: what the two tiers together hold for it."""
    best, k = 0, 0
    while (k + 1) * B < len(prompt):
        full = prompt[: (k + 1) * B]
        if full not in there.kv and full not in here.kv_by_block.get(k, ()):
            break
        k += 1
        p = k * B
        if p % unit == 0 and (prompt[:p] in there.states or prompt[:p] in here.states):
            best = p
    return best


class ExpectedHit(Checker):
    name = "expected-hit"

    def __init__(self):
        self.decl: dict | None = None
        self.window = LookupWindow()
        self.remote_floor: dict[str, int] = {}  # waiting request -> least remote reuse seen
        self.excused: set[str] = set()  # requests whose remote reuse a correct cache could not have had
        self.seen_events = 0
        self.distrusted: set[str] = set()  # host entries a load of which broke: a cache may stop trusting them

    def attached(self, session) -> None:
        self.decl = declared_retention(session)
        self.unit = (self.decl or {}).get("tier_unit") or session.layout.block_size

    # -- the remote tier ------------------------------------------------------------------
    def _remote(self, session, prompt: Prefix, view) -> int:
        B, unit = session.layout.block_size, self.unit
        store = session.runner.transport.store
        if not store.entries:
            return 0
        best = longest_held(prompt, INDEXES.get(view, B), StoreIndex(store, B, self.distrusted), B, unit)
        if best and view is not None:
            need_blocks = best // B + 1
            free_blocks = sum(1 for r in view.kv_refcounts.values() if r == 0)
            free_slots = sum(1 for r in view.state_refcounts.values() if r == 0)
            if view.kv_refcounts and (free_blocks < need_blocks or free_slots < 2):
                return -1  # no room to bring it in: excused
        return best

    def _note_broken_loads(self, session) -> None:
        """Requests whose loads a fault or a decision broke (from the history)."""
        events = session.history.events
        for ev in events[self.seen_events:]:
            if ev.get("event") == "fault" and ev.get("transfer", {}).get("direction") == "load":
                what = ev.get("what", "")
                if not what.startswith("decided: ok"):
                    self.excused.add(ev["transfer"].get("request_id"))
                    self.distrusted.add(ev["transfer"].get("key"))
            elif ev.get("event") == "transfer-done" and not ev.get("ok"):
                owner = self._owner(session, ev["id"])
                if owner is not None:
                    self.excused.add(owner[0])
                    self.distrusted.add(owner[1])
        self.seen_events = len(events)

    @staticmethod
    def _owner(session, transfer_id: int) -> tuple[str, str] | None:
        """The request and the host key of a transfer, from the plan that issued it."""
        for ev in reversed(session.history.events):
            for t in ev.get("transfers", ()) if ev.get("event") == "plan" else ():
                if t["id"] == transfer_id:
                    return t["request_id"], t["key"]
        return None

    # -- phases ---------------------------------------------------------------------------
    def scheduled(self, session, plan, view) -> None:
        if self.decl is None or view is None or self.decl.get("tier_unit") is None:
            return
        # Loads broken since the last step the checkers saw (a step that only
        # completed transfers need not reach ``stepped``): not held for anyone.
        self._note_broken_loads(session)
        waiting = [rid for rid, t in session.tracks.items() if not t.done and t.computed is None]
        for rid in waiting:
            track = session.tracks[rid]
            r = self._remote(session, track.tokens[: track.prompt_len], view)
            self.remote_floor[rid] = min(self.remote_floor.get(rid, r), r)

    def computed(self, session, executed) -> None:
        rs = executed.step
        track = session.tracks[rs.request_id]
        if track.computed is not None or rs.start == 0:
            return
        held = "conv ok" in executed.reads and "matrix ok" in executed.reads and executed.reads.endswith("): ok")
        if not held:
            raise ConformanceFailure("invariant", f"request {rs.request_id} reused {rs.start} tokens, more than "
                                                  f"memory held for it: {executed.reads}")

    def stepped(self, session, record) -> None:
        if self.decl is None:
            return
        self._note_broken_loads(session)
        floors = self.window.observe(session, record.plan, record.view_before)
        for rid, (_kv, local) in floors.items():
            rs = next(r for r in record.plan.requests if r.request_id == rid)
            remote = self.remote_floor.pop(rid, 0)
            if rid in self.excused or remote < 0:
                remote = 0
            expected = max(local, remote)
            session.coverage["expected_hits"] = session.coverage.get("expected_hits", 0) + 1
            if remote > local:
                session.coverage["remote_expected"] = session.coverage.get("remote_expected", 0) + 1
            if rs.start < expected:
                tier = "the host tier" if remote > local else "the device"
                raise ConformanceFailure("hit-rate", f"request {rid} reused {rs.start} tokens, but a correct cache "
                                                     f"could reuse {expected} (device {local}, host tier {remote}, "
                                                     f"compared in tokens; the longer is on {tier})")
