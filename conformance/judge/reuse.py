"""What a cache view could serve to a prompt: the longest prefix its KV covers
and the longest prefix it could reuse whole (KV and recurrent state).

The metrics and the hit-rate check both ask this of the implementation's own
view; memory already proved the view honest (``invariants.check_view``), so
what the view lists is really there.
"""

from __future__ import annotations

from conformance.contract import CacheView

Prefix = tuple[int, ...]


def _by_block(entries, block_size: int) -> tuple[dict[int, set[Prefix]], dict[tuple[int, int], set[Prefix]]]:
    """Cached KV entries by block index: the full attention layers' (a window group's block serves
    none of them), and each window group's by (group, block index)."""
    kv: dict[int, set[Prefix]] = {}
    win: dict[tuple[int, int], set[Prefix]] = {}
    for e in entries:
        if e.tokens:
            k = (len(e.tokens) - 1) // block_size
            (kv.setdefault(k, set()) if e.window_group is None else win.setdefault((e.window_group, k), set())).add(
                e.tokens)
    return kv, win


class ViewIndex:
    """A view's cached content, indexed for prefix questions (built on first
    use: most views are never asked)."""

    def __init__(self, view: CacheView | None, block_size: int, windows: tuple[int, ...] = ()):
        self.view = view
        self.block_size = block_size
        # The model's window groups (Memory.windows: the window of each); empty: not asked of window groups
        self.windows = windows
        self._kv: dict[int, set[Prefix]] | None = None  # block index -> prefixes through its last valid position
        self._win: dict[tuple[int, int], set[Prefix]] | None = None  # (window group, block index) -> the same
        self._states: set[Prefix] | None = None

    @classmethod
    def of(cls, view: CacheView | None, block_size: int) -> ViewIndex:
        return cls(view, block_size)

    @property
    def kv_by_block(self) -> dict[int, set[Prefix]]:
        """The full attention layers' blocks (a window group's block serves no full attention layer)."""
        if self._kv is None:
            self._kv, self._win = _by_block(self.view.cached_kv if self.view is not None else (), self.block_size)
        return self._kv

    @property
    def win_by_block(self) -> dict[tuple[int, int], set[Prefix]]:
        self.kv_by_block  # noqa: B018  (builds both)
        assert self._win is not None
        return self._win

    def windows_held(self, prompt: Prefix, p: int, there=None) -> bool:
        """Whether every window group holds the KV a step resuming at ``p`` reads: the positions
        [p - W + 1, p) of ``prompt``, here or in ``there`` (a host store's index, ``StoreIndex``).
        True for a model without window layers."""
        B = self.block_size
        for g, w in enumerate(self.windows):
            for k in range(max(0, p - w + 1) // B, (p + B - 1) // B):
                here = self.win_by_block.get((g, k), set())
                remote = there.win.get(g, set()) if there is not None else set()
                if (k + 1) * B <= p:
                    if prompt[: (k + 1) * B] not in here and prompt[: (k + 1) * B] not in remote:
                        return False
                elif not any(len(e) >= p and e[:p] == prompt[:p] for e in (*here, *remote)):
                    return False
        return True

    @property
    def states(self) -> set[Prefix]:
        if self._states is None:
            self._states = {e.tokens for e in self.view.cached_states} if self.view is not None else set()
        return self._states

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

    def best_reuse(self, prompt: Prefix, kv_len: int | None = None, also: ViewIndex | None = None) -> int:
        """Longest p <= the KV hit with a cached state after ``prompt[:p]``
        (in ``also`` too, when given)."""
        top = self.kv_servable(prompt) if kv_len is None else kv_len
        for p in range(top, 0, -1):
            if prompt[:p] in self.states and (also is None or prompt[:p] in also.states) \
                    and self.windows_held(prompt, p):
                return p
        return 0


class HeldAcross(ViewIndex):
    """The entries two views of one ``schedule()`` both list *as the same
    entry* (the same KV block or state slot under the same prefix): what the
    cache held through it.  Intersecting by prefix alone would count an entry
    the schedule evicted (another request's allocation took its slot) as held
    when the schedule also registered the same prefix elsewhere, in the
    blocks or the slot of the very request being matched (a cache that
    registers what a plan is about to compute, as vLLM does at allocation)."""

    def __init__(self, before: CacheView | None, after: CacheView | None, block_size: int,
                 windows: tuple[int, ...] = ()):
        super().__init__(None, block_size, windows)
        if before is None or after is None:
            self._kv, self._win, self._states = {}, {}, set()
            return
        kept_kv = {(e.block, e.window_group, e.tokens) for e in before.cached_kv}
        kept_states = {(e.slot, e.tokens) for e in before.cached_states}
        self._kv, self._win = _by_block((e for e in after.cached_kv if (e.block, e.window_group, e.tokens) in kept_kv),
                                        block_size)
        self._states = {e.tokens for e in after.cached_states if (e.slot, e.tokens) in kept_states}


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
    served over every schedule() of that window: :meth:`observe` after each
    step, and :meth:`look` at a schedule() whose plan computed nothing (for a
    checker that wants those too: the expected-hit oracle does)."""

    def __init__(self, hit_drop: int = 0):
        # Speculative decoding with EAGLE / MTP: a non-zero KV hit gives back
        # this many tokens (Speculation.hit_drop), then a state there.
        self.hit_drop = hit_drop
        self.floor: dict[str, tuple[int, int]] = {}  # request -> (KV servable, reusable with a state)
        self.pending: set[str] = set()  # submitted, not started
        self.known = 0  # tracks seen so far
        self._session = None

    def observe(self, obs, plan, view_before) -> dict[str, tuple[int, int]]:
        """Update the window after a step; return the floors of the requests
        whose first step this plan was."""
        self._sync(obs)
        tracks = obs.tracks
        started = {rs.request_id for rs in plan.requests if tracks[rs.request_id].steps == 1}
        for rid in [r for r in self.pending if r not in started and (tracks[r].steps or tracks[r].done)]:
            self.pending.discard(rid)  # aborted before it started (a started one is handled below)
            self.floor.pop(rid, None)
        if not self.pending:
            return {}
        # what the cache held for a lookup: before schedule() and still after it
        self._look(obs, view_before, obs.plan_view, self.pending)
        out = {rid: self.floor.pop(rid) for rid in self.pending & started}
        self.pending -= started
        return out

    def look(self, obs, view_before, view_after) -> None:
        """A schedule() that computed nothing (its plan carries transfers or
        copies only, so no step follows it): the waiting requests could have
        been matched there too.  Without it the window would miss the
        schedules in which a request waited for its own loads, and its floor
        would already count the blocks those loads brought in."""
        self._sync(obs)
        if view_after is not None:  # None: a stall, nothing changed
            self._look(obs, view_before, view_after, [r for r in self.pending if not obs.tracks[r].done])

    def _sync(self, obs) -> None:
        if obs is not self._session:  # one metrics object follows every session of a check
            self._session, self.floor, self.pending, self.known = obs, {}, set(), 0
        tracks = obs.tracks
        if len(tracks) > self.known:  # tracks only grow, in submission order: take the new ones
            keys = reversed(tracks)
            self.pending.update(next(keys) for _ in range(len(tracks) - self.known))
            self.known = len(tracks)

    def _look(self, obs, view_before, view_after, rids) -> None:
        B, tracks = obs.layout.block_size, obs.tracks
        held = HeldAcross(view_before, view_after, B, obs.memory.windows)
        for rid in rids:
            prompt = tracks[rid].tokens[: tracks[rid].prompt_len]
            kv = held.kv_servable(prompt)
            now = (kv, held.best_reuse(prompt, max(0, kv - self.hit_drop) if kv else 0))
            old = self.floor.get(rid, now)
            self.floor[rid] = (min(old[0], now[0]), min(old[1], now[1]))
