"""What a cache view could serve to a prompt: the longest prefix its KV covers
and the longest prefix it could reuse whole (KV and recurrent state).

The metrics and the hit-rate check both ask this of the implementation's own
view; memory already proved the view honest (``invariants.check_view``), so
what the view lists is really there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract import CacheView

Prefix = tuple[int, ...]


@dataclass
class ViewIndex:
    """A view's cached content, indexed for prefix questions."""

    block_size: int
    kv_by_block: dict[int, set[Prefix]]  # block index -> prefixes through that block's last valid position
    states: set[Prefix]

    @classmethod
    def of(cls, view: CacheView | None, block_size: int) -> "ViewIndex":
        kv: dict[int, set[Prefix]] = {}
        states: set[Prefix] = set()
        if view is not None:
            for e in view.cached_kv:
                if e.tokens:
                    kv.setdefault((len(e.tokens) - 1) // block_size, set()).add(e.tokens)
            states = {e.tokens for e in view.cached_states}
        return cls(block_size, kv, states)

    def tracks_kv(self) -> bool:
        return bool(self.kv_by_block)

    def both(self, other: "ViewIndex") -> "ViewIndex":
        """Entries cached in both views: what survived between them."""
        kv = {i: s & other.kv_by_block.get(i, set()) for i, s in self.kv_by_block.items()}
        return ViewIndex(self.block_size, {i: s for i, s in kv.items() if s}, self.states & other.states)

    def kv_servable(self, prompt: Prefix) -> int:
        """Longest prefix of ``prompt`` (leaving one token to compute) whose KV is cached."""
        B, cap, n, i = self.block_size, len(prompt) - 1, 0, 0
        while n < cap:
            entries = self.kv_by_block.get(i)
            if not entries:
                break
            full = prompt[: (i + 1) * B]
            if len(full) == (i + 1) * B and full in entries:
                n, i = (i + 1) * B, i + 1
                continue
            best = 0  # a block whose content agrees with the prompt only partly, or a partly filled one
            for e in entries:
                if e[: i * B] != prompt[: i * B]:
                    continue
                k = i * B
                while k < len(e) and k < len(prompt) and e[k] == prompt[k]:
                    k += 1
                best = max(best, k)
            n = max(n, best)
            break
        return min(n, max(cap, 0))

    def best_reuse(self, prompt: Prefix, kv_len: int | None = None) -> int:
        """Longest p <= the KV hit with a cached state after ``prompt[:p]``."""
        top = self.kv_servable(prompt) if kv_len is None else kv_len
        for p in range(top, 0, -1):
            if prompt[:p] in self.states:
                return p
        return 0


class IndexCache:
    """Views are immutable snapshots: index each once, however many observers
    ask (the retention check and the metrics read the same views)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._entries: list[tuple[object, int, ViewIndex]] = []  # (view held alive, block size, index)

    def get(self, view: CacheView | None, block_size: int) -> ViewIndex:
        for v, b, index in self._entries:
            if v is view and b == block_size:
                return index
        index = ViewIndex.of(view, block_size)
        self._entries = [(view, block_size, index)] + self._entries[: self.keep - 1]
        return index


INDEXES = IndexCache()


class LookupWindow:
    """What the cache could have served each new request when it was matched.

    An implementation matches a request at some schedule() between its
    submission and its first computed step (the reference admits ahead of
    computing), and registrations made after that cannot be held against it.
    So the harness keeps, per waiting request, the *least* it could have been
    served over every schedule() of that window."""

    def __init__(self):
        self.floor: dict[str, tuple[int, int]] = {}  # request -> (KV servable, reusable with a state)

    def observe(self, session, plan, view_before) -> dict[str, tuple[int, int]]:
        """Update the window after a step; return the floors of the requests
        whose first step this plan was."""
        B = session.layout.block_size
        held = None
        started = {rs.request_id for rs in plan.requests if session.tracks[rs.request_id].steps == 1}
        out = {}
        for rid, track in session.tracks.items():
            if rid not in started and (track.steps or track.done):
                continue  # neither waiting to start nor starting now
            if held is None:  # what the cache held for a lookup: before schedule() and still after it
                held = INDEXES.get(view_before, B).both(INDEXES.get(session.plan_view, B))
            prompt = track.tokens[: track.prompt_len]
            kv = held.kv_servable(prompt)
            now = (kv, held.best_reuse(prompt, kv))
            old = self.floor.get(rid, now)
            self.floor[rid] = (min(old[0], now[0]), min(old[1], now[1]))
            if rid in started:
                out[rid] = self.floor.pop(rid)
        return out
