"""The reference hybrid cache: a correct implementation of the contract.

Attention KV lives in paged blocks matched token by token (a hit may end inside
a block); recurrent states are reusable only where a snapshot was registered.
Both groups are reconciled to one prefix length: the longest position p that
the KV covers *and* at which a snapshot exists.  Chunks are cut at checkpoints
so that every snapshot is a step's final state, registered in place; the
request then moves on with copy-before-extend.

Sliding-window layers (``ImplConfig.windows``, one group per window): each
group has a block table of its own, from the same pool.  A block that left
every position's window (``computed - W + 1`` past its end) is let go at once,
on what the request has computed (never on what a step in flight will have
computed), and stays cached until the pool reuses it, as vLLM's
``SlidingWindowManager`` frees with ``remove_skipped_blocks``.  A hit at p
needs, in every window group, the blocks of [p - W + 1, p) (found right to
left from p), on top of the full layers' KV and a state: one length in tokens
for every group, the longest at which all of them hold.

Each decision lives in a small method so that a mutant (``fault_injection``)
can override exactly one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.adapters.reference.block_pool import ROOT, BlockPool, chain
from conformance.adapters.reference.host_tier import HostTier
from conformance.adapters.reference.policy import RetentionPolicy, Sightings
from conformance.adapters.reference.speculative import SpecOptions, SpeculativeDecoding
from conformance.adapters.reference.state_pool import StatePool
from conformance.contract import (
    FRESH,
    NULL_BLOCK,
    RESUME,
    CachedKV,
    CachedState,
    CacheView,
    ImplConfig,
    Layout,
    Request,
    RequestStep,
    StateInit,
    StepPlan,
    StepResult,
    copy_from,
)


@dataclass
class _Req:
    request_id: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    generated: int = 0
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    init: StateInit = FRESH
    pins: list[tuple[str, int]] = field(default_factory=list)  # held until the step ran
    offered: int = -1  # last position offered for retention: one sighting per request and position
    # speculative decoding (speculative.py)
    proposed: tuple[int, ...] = ()  # drafts proposed for the next step
    spare: list[int] = field(default_factory=list)  # state slots for the verified positions, held
    resume_slot: int | None = None  # the slot holding the state at ``computed`` when not ``slot``
    # sliding windows: per window group, the block table (NULL_BLOCK: let go, it left the window)
    windows: list[list[int]] = field(default_factory=list)


@dataclass
class Match:
    """A prefix hit: ``length`` tokens reused, KV from ``blocks``, state from ``slot``."""

    length: int
    blocks: list[int]
    slot: int | None
    # per window group, the hit's table: NULL_BLOCK before the window at ``length``, then cached blocks
    windows: list[list[int]] = field(default_factory=list)


class ReferenceCache(SpeculativeDecoding):
    name = "reference"
    version = "1.0"
    tier_option = ("host_tier", True)  # how the harness turns the second tier on (faults, tier mutants)
    spec_option = ("spec_tokens", 3)  # how the harness turns speculative decoding on (the "spec" family)
    # The disaggregated mode the "disagg" family runs (prefill and decode workers; a class
    # attribute, so the single-worker contract is untouched).
    from conformance.adapters.reference.disagg import ReferenceDisagg as disagg_factory  # noqa: E402

    @classmethod
    def validate_options(cls, config: ImplConfig) -> None:
        """Raises ValueError for options this cache rejects (the harness makes that a usage error)."""
        RetentionPolicy.from_options(config.options, config.block_size)
        SpecOptions.from_options(config.options)

    def __init__(self, config: ImplConfig | None = None):
        config = config or ImplConfig()
        self.config = config
        self.B = config.block_size
        self.windows = tuple(config.windows)  # the window of each window group
        self.policy = RetentionPolicy.from_options(config.options, self.B)
        self.spec = SpecOptions.from_options(config.options)
        self.kv = BlockPool(config.num_kv_blocks)
        self.states = StatePool(config.num_state_slots)
        self.sightings = Sightings()
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.stats = {"lookups": 0, "hit_tokens": 0, "snapshots": 0}
        # Optional second tier: evicted entries go to the harness's host store (host_tier.py).
        self.tier = HostTier(self) if config.options.get("host_tier") else None

    # -- contract ------------------------------------------------------------------
    def layout(self) -> Layout:
        return Layout(self.B, self.config.num_kv_blocks, self.config.num_state_slots)

    def add_request(self, request: Request) -> None:
        self.waiting.append(_Req(request.request_id, list(request.prompt), len(request.prompt),
                                 request.max_new_tokens))

    def schedule(self, budget: int) -> StepPlan:
        steps: list[RequestStep] = []
        kv_copies: list[tuple[int, int]] = []
        for req in list(self.waiting):
            if self.tier is not None:
                # The tiers are compared right before admission: an earlier
                # request admitted in this very schedule may have evicted
                # part of this one's local hit.
                self.tier.plan_loads([req])
                if self._waits_for_loads(req.request_id):
                    continue  # admitted once its loads have completed (or failed)
            if self._admit(req, kv_copies):
                self.waiting.remove(req)
                self.running.append(req)
                if self.tier is not None:
                    self.tier.admitted(req.request_id)
        for req in self.running:
            if budget <= 0:
                break
            step = self._plan_request(req, budget)
            if step is not None:
                steps.append(step)
                budget -= step.end - step.start
        return StepPlan(requests=tuple(steps), kv_copies=tuple(kv_copies),
                        transfers=self.tier.take() if self.tier is not None else ())

    def update(self, plan: StepPlan, result: StepResult) -> list[str]:
        finished = []
        if self.tier is not None:
            self.tier.complete(result.transfers)
        for step in plan.requests:
            req = self._find(step.request_id)
            self._unpin(req)
            if step.drafts:
                self._verified(req, step, result.accepted.get(step.request_id, 0), result.sampled.get(step.request_id))
            else:
                req.computed = step.end
                self._register_blocks(req)
                if self.policy.is_checkpoint(step.end, req.prompt_len, self.B) or self._sighted(req, step.end):
                    self._register_snapshot(req)
            if self.windows:
                self._slide_windows(req)
            if step.request_id in result.sampled:
                req.tokens.append(result.sampled[step.request_id])
                req.generated += 1
            if req.generated >= req.max_new:  # after a token, or accepted drafts that reached the end
                self._finish(req)
                finished.append(req.request_id)
        return finished

    def abort(self, request_id: str) -> None:
        req = self._find(request_id)
        if self.tier is not None:
            self.tier.forget(request_id)
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self._unpin(req)
        self._free(req)

    def retention(self) -> dict:
        """The declared policy (optional in the contract): the harness checks it."""
        decl = self.policy.declaration(self.B)
        if self.tier is not None:
            decl["tier_unit"] = self.B  # the host tier brings back whole blocks and states at their boundaries
        return decl

    def view(self) -> CacheView:
        return CacheView(
            kv_refcounts=dict(enumerate(self.kv.ref)),
            state_refcounts=dict(enumerate(self.states.ref)),
            cached_kv=tuple(self._entry(CachedKV, b, meta[2]) for b, meta in self.kv.meta.items())
            + tuple(self._entry(CachedKV, b, meta[3], meta[0]) for b, meta in self.kv.win_meta.items()),
            cached_states=tuple(self._entry(CachedState, s, prefix) for s, prefix in self.states.snap.items()),
            running=tuple(r.request_id for r in self.running),
            host_cached=self.tier.listing() if self.tier is not None else ())

    def _entry(self, kind, ident: int, prefix: tuple[int, ...], group: int | None = None):
        """View entries are immutable: rebuild one only when its content changed
        (a replay with thousands of cached prefixes asks for a view every step)."""
        memo = self.__dict__.setdefault("_view_memo", {})
        e = memo.get((kind, ident, group))
        if e is None or e.tokens is not prefix:
            e = memo[(kind, ident, group)] = kind(ident, prefix) if group is None else kind(ident, prefix, group)
        return e

    # -- admission: prefix match and reconciliation ----------------------------------
    def _admit(self, req: _Req, kv_copies: list) -> bool:
        """Find the reusable prefix, take references, allocate the running slot.
        References on the hit come first, so the allocations below cannot
        evict what the request is about to reuse."""
        match = self._match(req.tokens[: req.prompt_len])
        if self.tier is not None:
            remote = self.tier.remote_length(req.request_id)
            if remote is not None:
                match = self._tier_match(req.tokens[: req.prompt_len], match, remote)
        if len(match.windows) != len(self.windows):  # a match made without the window groups
            match.windows = self._window_hit(req.tokens[: req.prompt_len], match.length) or \
                [[NULL_BLOCK] * -(-match.length // self.B) for _ in self.windows]
        window_blocks = [b for table in match.windows for b in table if b != NULL_BLOCK]
        for b in match.blocks + window_blocks:
            self.kv.acquire(b)
        if match.slot is not None:
            self.states.acquire(match.slot)
        # The hit ends inside its last block and the request will write the
        # rest of that block: it gets a private copy (copy-on-write), in every group.
        tails = [t for t in (match.blocks, *match.windows) if t and t[-1] != NULL_BLOCK] \
            if match.length % self.B else []
        own = [self.kv.allocate() for _ in tails]
        slot = self.states.allocate()
        if slot is None or None in own:
            for b in match.blocks + window_blocks + [b for b in own if b is not None]:
                self.kv.release(b)
            for s in (match.slot, slot):
                if s is not None:
                    self.states.release(s)
            return False
        req.slot = slot
        for table, copy in zip(tails, own):
            assert copy is not None  # checked above
            kv_copies.append((table[-1], copy))
            req.pins.append(("kv", table[-1]))  # released once the copy has run
            table[-1] = copy
        req.blocks = match.blocks
        req.windows = [list(t) for t in match.windows]
        req.computed = match.length
        if match.slot is None:
            req.init = FRESH
        else:
            req.pins.append(("state", match.slot))
            req.init = copy_from(match.slot)
        self.stats["lookups"] += 1
        self.stats["hit_tokens"] += match.length
        return True

    # -- the second tier: compared in tokens, every group reconciled ------------------
    def _remote_wins(self, local: int, remote: int) -> bool:
        """Tokens against tokens: a local hit ending inside a block counts
        every token it has (a tie stays local: no transfer for the same reuse)."""
        return remote > local

    def _reserve_local_tail(self, prompt: list[int], local: int) -> int | None:
        """A block for the local hit's partial tail, held while the tiers are
        compared.  The hit is held meanwhile, so the reservation cannot evict it."""
        if local % self.B == 0:
            return None
        match = self._match(prompt)
        for b in match.blocks:
            self.kv.acquire(b)
        if match.slot is not None:
            self.states.acquire(match.slot)
        block = self.kv.allocate()
        for b in match.blocks:
            self.kv.release(b)
        if match.slot is not None:
            self.states.release(match.slot)
        return block

    def _release_local_tail(self, block: int | None) -> None:
        if block is not None:
            self.kv.release(block)

    def _remote_won(self, block: int | None) -> None:
        """The remote tier won: the block held for the shorter local tail goes back."""
        self._release_local_tail(block)

    def _waits_for_loads(self, request_id: str) -> bool:
        """A request whose loads are in flight is admitted once they completed."""
        return self.tier is not None and self.tier.is_loading(request_id)

    def _tier_match(self, prompt: list[int], match: Match, remote: int) -> Match:
        """After the remote tier's loads landed: the loaded blocks and state
        joined the device cache, so the longest match (at least the remote
        length) already reconciles every group to one length."""
        return match

    def _match(self, prompt: list[int]) -> Match:
        kv_len, blocks, keys = self._match_kv(prompt)
        return self._reconcile(prompt, self._hit_kv_length(kv_len), blocks, keys)

    def _match_kv(self, prompt: list[int]) -> tuple[int, list[int], list[int]]:
        """Longest KV prefix, token by token.  ``keys[i]`` is the chain key of
        the first i full blocks."""
        B, parent, n, blocks, keys = self.B, ROOT, 0, [], [ROOT]
        while n < len(prompt):
            want = tuple(prompt[n: n + B])
            block, common = self.kv.lookup(parent, want)
            if block is None or common == 0:
                break
            blocks.append(block)
            n += common
            if common < B:
                break
            parent = chain(parent, want)
            keys.append(parent)
        return n, blocks, keys

    def _reconcile(self, prompt: list[int], kv_len: int, blocks: list[int], keys: list[int]) -> Match:
        """One prefix length for every group: the longest p <= the KV hit at
        which a state snapshot exists and every window group holds the window
        (at least one token is left to compute)."""
        for p in range(min(kv_len, len(prompt) - 1), 0, -1):
            slot = self.states.lookup(tuple(prompt[:p]))
            if slot is not None:
                windows = self._window_hit(prompt, p)
                if windows is not None:
                    return Match(p, blocks[: -(-p // self.B)], slot, windows)
        return Match(0, [], None, [[] for _ in self.windows])

    # -- sliding windows --------------------------------------------------------------
    def _window_hit(self, prompt: list[int], p: int) -> list[list[int]] | None:
        """Each window group's table for a hit at ``p``: NULL_BLOCK before the
        window, then the cached blocks of [p - W + 1, p) (the last one may hold
        more than p's block needs); None when some group lacks one."""
        B, n = self.B, -(-p // self.B)
        keys = self._chain_keys(prompt, n)
        tables = []
        for g, w in enumerate(self.windows):
            first = max(0, p - w + 1) // B
            table = [NULL_BLOCK] * first
            for i in range(first, n):
                block, common = self.kv.lookup(keys[i], tuple(prompt[i * B: (i + 1) * B]), g)
                if block is None or common < min(B, p - i * B):
                    return None
                table.append(block)
            tables.append(table)
        return tables

    def _chain_keys(self, tokens: list[int], n: int) -> list[int]:
        """``keys[i]``: the chain key of the first i blocks of ``tokens`` (i < n)."""
        keys = [ROOT]
        for i in range(n - 1):
            keys.append(chain(keys[-1], tuple(tokens[i * self.B: (i + 1) * self.B])))
        return keys

    def _slide_windows(self, req: _Req) -> None:
        """After a step: the window blocks it completed become reusable, and
        those that left every window of what the request computed go back to
        the pool (cached until reused)."""
        self._register_window_blocks(req)
        self._free_left_window(req, req.computed)

    def _register_window_blocks(self, req: _Req) -> None:
        B, parent = self.B, ROOT
        for i in range(req.computed // B):
            tokens = tuple(req.tokens[i * B: (i + 1) * B])
            prefix = None
            for g, table in enumerate(req.windows):
                if i < len(table) and table[i] != NULL_BLOCK:
                    prefix = prefix or tuple(req.tokens[: (i + 1) * B])
                    self.kv.register(parent, tokens, prefix, table[i], g)
            parent = chain(parent, tokens)

    def _free_left_window(self, req: _Req, computed: int) -> None:
        """Let go of the blocks no position from ``computed`` on reads (vLLM's
        ``remove_skipped_blocks`` on the committed count)."""
        for w, table in zip(self.windows, req.windows):
            for i in range(min(len(table), max(0, computed - w + 1) // self.B)):
                if table[i] != NULL_BLOCK:
                    self.kv.release(table[i])
                    table[i] = NULL_BLOCK

    # -- one request's share of a step ------------------------------------------------
    def _plan_request(self, req: _Req, budget: int) -> RequestStep | None:
        remaining = len(req.tokens) - req.computed
        if remaining <= 0:
            return None
        n = min(remaining, budget)
        cut = self._next_sighted(req, self.policy.next_checkpoint(req.computed, req.prompt_len, self.B))
        if cut is not None:
            n = min(n, cut - req.computed)
        end = req.computed + n
        drafts = self._drafts_for(req, end, budget - n) if self.spec.tokens else ()
        if not (drafts and self._grow(req, end + len(drafts))):
            drafts = ()
            if not self._grow(req, end):
                return None
        if self.spec.tokens:
            self._resume(req, bool(drafts))  # after a verification: the accepted column runs on
        if req.slot is None:  # the previous slot became a snapshot: copy before extend
            req.slot = self.states.allocate()
            if req.slot is None:
                return None
        init, req.init = req.init, RESUME
        drafts, draft_slots, snapshots = self._verification(req, end, drafts)
        req.proposed = ()  # a proposal lasts until the request's next step
        return RequestStep(req.request_id, req.computed, end, tuple(req.blocks), req.slot, init,
                           snapshots=snapshots, drafts=drafts, draft_slots=draft_slots,
                           window_tables=tuple(tuple(t) for t in req.windows))

    def _grow(self, req: _Req, end: int) -> bool:
        n = -(-end // self.B)
        if not req.windows and self.windows:
            req.windows = [[] for _ in self.windows]
        need = n - len(req.blocks) + sum(max(0, n - len(t)) for t in req.windows)
        if need > self.kv.num_free():
            return False
        for table in (req.blocks, *req.windows):
            while len(table) < n:
                block = self.kv.allocate()
                assert block is not None  # num_free() counted it
                table.append(block)
        return True

    # -- bookkeeping after a step ---------------------------------------------------
    def _register_blocks(self, req: _Req) -> None:
        """Full blocks become reusable once completely written."""
        B, parent = self.B, ROOT
        for i in range(req.computed // B):
            tokens = tuple(req.tokens[i * B: (i + 1) * B])
            self.kv.register(parent, tokens, tuple(req.tokens[: (i + 1) * B]), req.blocks[i])
            parent = chain(parent, tokens)

    def _register_snapshot(self, req: _Req) -> None:
        """The running slot holds the state at ``computed``: register it in
        place, and continue from a copy in a fresh slot next step."""
        prefix = tuple(req.tokens[: req.computed])
        if req.offered == req.computed:  # a prompt end that is also the sequence end: one sighting
            return
        req.offered = req.computed
        if not self._should_admit(prefix):
            return  # the request keeps extending its slot: nothing to copy
        assert req.slot is not None  # it just ran in its slot
        if self.states.register(prefix, req.slot):
            self.stats["snapshots"] += 1
            # The request's reference becomes a pin until the copy has run.
            req.pins.append(("state", req.slot))
            req.init = copy_from(req.slot)
            req.slot = None

    def _should_admit(self, prefix: tuple[int, ...]) -> bool:
        """Admission: every checkpoint, or (second-hit) only a prefix sighted before."""
        if self.policy.admission == "always":
            return True  # no need to count what is never consulted
        return self.sightings.see(prefix) >= 2

    def _sighted(self, req: _Req, pos: int) -> bool:
        """Second-hit: a prefix an earlier request offered is a checkpoint for
        every request that computes through it (that is its next sighting)."""
        return self.policy.admission == "second-hit" and tuple(req.tokens[:pos]) in self.sightings.counts

    def _next_sighted(self, req: _Req, cut: int | None) -> int | None:
        """The chunk ends at the first such prefix before ``cut``, so that its
        state can be registered in place."""
        if self.policy.admission != "second-hit" or not self.sightings.counts:
            return cut
        for q in range(req.computed + 1, len(req.tokens) if cut is None else cut):
            if self._sighted(req, q):
                return q
        return cut

    def _register_tail(self, req: _Req) -> None:
        """At the end of a request its partly filled last block is reusable too
        (in every group)."""
        B, n = self.B, req.computed
        if n % B and len(req.blocks) > n // B:
            parent = ROOT
            for i in range(n // B):
                parent = chain(parent, tuple(req.tokens[i * B: (i + 1) * B]))
            self.kv.register(parent, tuple(req.tokens[n // B * B: n]), tuple(req.tokens[:n]), req.blocks[n // B])
            for g, table in enumerate(req.windows):
                if len(table) > n // B and table[n // B] != NULL_BLOCK:
                    self.kv.register(parent, tuple(req.tokens[n // B * B: n]), tuple(req.tokens[:n]), table[n // B], g)

    def _finish(self, req: _Req) -> None:
        self._resume(req, True)  # the state at the sequence's end may sit in a verified column
        self._register_tail(req)
        if req.slot is not None:
            self._register_snapshot(req)
        self._unpin(req)
        self._free(req)

    def _free(self, req: _Req) -> None:
        self._release_blocks(req.blocks)
        self._release_blocks([b for table in req.windows for b in table if b != NULL_BLOCK])
        req.windows = []
        if req.slot is not None:
            self.states.release(req.slot)
        self._release_spare(req)
        req.blocks, req.slot = [], None
        if req in self.running:
            self.running.remove(req)

    def _release_blocks(self, blocks: list[int]) -> None:
        """A request lets go of its KV blocks (shared ones stay for their other holders)."""
        for b in blocks:
            self.kv.release(b)

    def _unpin(self, req: _Req) -> None:
        for kind, ident in req.pins:
            (self.kv if kind == "kv" else self.states).release(ident)
        req.pins = []

    def _find(self, request_id: str) -> _Req:
        for req in self.running + self.waiting:
            if req.request_id == request_id:
                return req
        raise KeyError(f"unknown request {request_id!r}")

