"""A radix-tree hybrid cache written from the README's contract alone (issue 34, findings a, b and d).

A tree of whole KV blocks: a node is one block of a prefix, and a recurrent
state lives on the node whose end it describes (SGLang's design).  Three
choices make it the witness of three correct designs the suite once failed:

- (a) eviction takes leaves only, a leaf's block and its state together; a
  state alone may go (a slot is wanted), never a block before the states
  past it: a recurrent state never outlives the KV before it, so
  ``kv-scarce`` never meets ``state_outlives_kv``;
- (b) ``PromptEndRadixCache`` keeps the state at a prompt's end only
  (``interval: 0``, vLLM's default ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL=0``);
- ``PagedRadixCache`` rounds every chunk up to a block's end (SGLang's pages);
- (d) a checkpoint is copied out into a free slot (``snapshots``), never
  registered in the running slot, and skipped when no slot is free: a
  finishing request's running slot is freed, not handed over, and a step's
  ``copy_from`` source is never overwritten by the same step.

A hit reuses whole blocks down the tree, and ends inside the next block
where a state lies there (a prompt's end, under (b)): that block is copied.
Refcounts count the requests that hold a block or a slot, the step's copy
sources and snapshot targets until ``update()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.contract import (
    FRESH,
    RESUME,
    CachedKV,
    CachedState,
    CacheView,
    ImplConfig,
    Layout,
    RequestStep,
    StateInit,
    StepPlan,
    copy_from,
)

Prefix = tuple[int, ...]


@dataclass
class _Node:
    block: int  # (a leaf may hold a partly written block: a finished request's tail)
    children: int = 0
    used: int = 0  # clock of the last hit or registration


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    generated: int = 0
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    shared: int = 0  # how many of ``blocks`` are tree nodes it holds (the rest are its own)
    slot: int | None = None
    init: StateInit = FRESH
    pins: list[int] = field(default_factory=list)  # this step's copy source and snapshot targets
    kv_pins: list[int] = field(default_factory=list)  # a copied block's source, until the copy ran
    snaps: list[tuple[int, int]] = field(default_factory=list)


class RadixCache:
    name, version = "radix", "0.1"
    prompt_end_only = False  # PromptEndRadixCache: states at prompt ends only

    def __init__(self, config: ImplConfig):
        self.B = config.block_size
        self.kv_ref = [0] * config.num_kv_blocks
        self.state_ref = [0] * config.num_state_slots
        self.free_blocks = list(range(config.num_kv_blocks))[::-1]
        self.free_slots = list(range(config.num_state_slots))[::-1]
        self.nodes: dict[Prefix, _Node] = {}  # whole-block prefix -> its last block
        self.block_of: dict[int, Prefix] = {}
        self.states: dict[Prefix, int] = {}  # prefix -> the slot holding the state after it
        self.slot_of: dict[int, Prefix] = {}
        self.state_used: dict[Prefix, int] = {}
        self.clock = 0
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []

    def layout(self) -> Layout:
        return Layout(self.B, len(self.kv_ref), len(self.state_ref))

    def retention(self) -> dict:
        if self.prompt_end_only:
            return {"interval": 0, "admission": "always", "prompt_ends": True, "sequence_ends": False}
        return {"interval": None, "admission": "always", "prompt_ends": False}

    def add_request(self, r) -> None:
        self.waiting.append(_Req(r.request_id, list(r.prompt), len(r.prompt), r.max_new_tokens))

    # -- the pools -------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _take_block(self) -> int | None:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # the least recently used leaf nobody holds goes, with every state past its start
            leaves = [(n.used, p) for p, n in self.nodes.items() if n.children == 0 and not self.kv_ref[n.block]]
            if not leaves:
                return None
            self._evict_leaf(min(leaves)[1])
            block = self.free_blocks.pop()
        self.kv_ref[block] = 1
        return block

    def _evict_leaf(self, prefix: Prefix) -> None:
        node = self.nodes.pop(prefix)
        del self.block_of[node.block]
        self.free_blocks.append(node.block)
        start = (len(prefix) - 1) // self.B * self.B  # where its block starts: its parent's end
        if start:
            self.nodes[prefix[:start]].children -= 1
        for p in [p for p in self.states if len(p) > start and p[: len(prefix)] == prefix[: len(p)]]:
            self._drop_state(p)  # the states this block's KV comes before go with it

    def _drop_state(self, prefix: Prefix) -> None:
        slot = self.states.pop(prefix)
        del self.slot_of[slot]
        self.state_used.pop(prefix, None)
        if not self.state_ref[slot]:
            self.free_slots.append(slot)

    def _take_slot(self, avoid: set[int] = frozenset()) -> int | None:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # a cached state nobody holds (its node keeps its KV)
            idle = [(self.state_used.get(p, 0), p) for p, s in self.states.items()
                    if not self.state_ref[s] and s not in avoid]
            if not idle:
                return None
            self._drop_state(min(idle)[1])
            slot = self.free_slots.pop()
        self.state_ref[slot] = 1
        return slot

    def _release_slot(self, slot: int) -> None:
        self.state_ref[slot] -= 1
        if not self.state_ref[slot] and slot not in self.slot_of:
            self.free_slots.append(slot)

    def _release_block(self, block: int) -> None:
        self.kv_ref[block] -= 1
        if not self.kv_ref[block] and block not in self.block_of:
            self.free_blocks.append(block)

    # -- admission -------------------------------------------------------------------------
    def _match(self, prompt: list[int]) -> tuple[int, list[int], int | None]:
        """The longest prefix (a token left to compute) whose KV and state are
        cached: whole blocks down the tree, and one more block of the tree
        that agrees with the prompt part of the way.  Where the state lies
        inside a block the request will write the rest of, that block is
        copied: its source is returned."""
        B, cap, blocks, k = self.B, len(prompt) - 1, [], 0
        while (k + 1) * B <= cap:
            node = self.nodes.get(tuple(prompt[: (k + 1) * B]))
            if node is None:
                break
            blocks.append(node.block)
            k += 1
        for p in range(min(cap, (k + 1) * B - 1), 0, -1):
            head = tuple(prompt[:p])
            if head not in self.states:
                continue
            if p <= k * B:
                used = blocks[: -(-p // B)]
                return p, used, used[-1] if p % B else None
            node = next((n for q, n in self.nodes.items() if k * B < len(q) <= (k + 1) * B and len(q) >= p
                         and q[:p] == head), None)
            if node is not None:
                return p, blocks + [node.block], node.block
        return 0, [], None

    def _admit(self, req: _Req, copies: list[tuple[int, int]]) -> bool:
        length, blocks, partial = self._match(req.tokens[: req.prompt_len])
        source = self.states.get(tuple(req.tokens[:length])) if length else None
        for b in blocks:  # held first: the allocations below cannot evict what the hit reuses
            self.kv_ref[b] += 1
        if source is not None:
            self.state_ref[source] += 1
        slot = self._take_slot()
        own = self._take_block() if partial is not None and slot is not None else None
        if slot is None or (partial is not None and own is None):
            for b in blocks:
                self._release_block(b)
            for s in (source, slot):
                if s is not None:
                    self._release_slot(s)
            return False
        now = self._tick()
        for k in range(1, length // self.B + 1):
            self.nodes[tuple(req.tokens[: k * self.B])].used = now
        if partial is not None and own is not None:
            # the hit ends inside a block the request will write the rest of: its own copy
            copies.append((partial, own))
            req.kv_pins.append(partial)  # released once the copy has run
            blocks[-1] = own
        req.blocks, req.shared, req.slot, req.computed = blocks, length // self.B, slot, length
        if source is None:
            req.init = FRESH
        else:
            self.state_used[tuple(req.tokens[:length])] = now
            req.init = copy_from(source)
            req.pins.append(source)
        return True

    # -- one step --------------------------------------------------------------------------
    def schedule(self, budget: int) -> StepPlan:
        copies: list[tuple[int, int]] = []
        for req in list(self.waiting):
            if not self._admit(req, copies):
                break
            self.waiting.remove(req)
            self.running.append(req)
        steps = []
        for req in self.running:
            n = min(len(req.tokens) - req.computed, self._chunk(req, budget))
            if n <= 0:
                continue
            step = self._plan(req, req.computed + n)
            if step is not None:
                steps.append(step)
                budget -= n
        return StepPlan(tuple(steps), kv_copies=tuple(copies))

    def _chunk(self, req: _Req, budget: int) -> int:
        """The tokens a request computes out of what the step's budget leaves."""
        return budget

    def _checkpoints(self, req: _Req, start: int, end: int) -> list[int]:
        if self.prompt_end_only:
            return [req.prompt_len] if start < req.prompt_len <= end else []
        return list(range((start // self.B + 1) * self.B, end + 1, self.B))

    def _plan(self, req: _Req, end: int) -> RequestStep | None:
        while len(req.blocks) * self.B < end:
            block = self._take_block()
            if block is None:
                return None  # waits for room (the generator's budget leaves it some once others finish)
            req.blocks.append(block)
        used = {s for r in self.running for s in (r.slot, *r.pins) if s is not None}
        for q in self._checkpoints(req, req.computed, end):
            if tuple(req.tokens[:q]) in self.states:
                continue
            slot = self._take_slot(avoid=used)  # never this step's copy sources
            if slot is None:
                break  # no slot is free: the checkpoint is skipped
            used.add(slot)
            req.snaps.append((q, slot))
            req.pins.append(slot)
        init, req.init = req.init, RESUME
        assert req.slot is not None  # given at admission, kept until the request finishes
        return RequestStep(req.rid, req.computed, end, tuple(req.blocks), req.slot, init,
                           snapshots=tuple(sorted(req.snaps)))

    def update(self, plan, result) -> list[str]:
        finished = []
        for rs in plan.requests:
            req = next(r for r in self.running if r.rid == rs.request_id)
            req.computed = rs.end
            now = self._tick()
            for q, slot in req.snaps:
                prefix = tuple(req.tokens[:q])
                if prefix not in self.states:
                    self.states[prefix], self.slot_of[slot] = slot, prefix
                    self.state_used[prefix] = now
            req.snaps = []
            for slot in req.pins:
                self._release_slot(slot)
            for block in req.kv_pins:
                self._release_block(block)
            req.pins, req.kv_pins = [], []
            self._register_blocks(req, now)
            if rs.request_id in result.sampled:
                req.tokens.append(result.sampled[rs.request_id])
                req.generated += 1
                if req.generated >= req.max_new:
                    finished.append(req.rid)
        for rid in finished:
            self._register_tail(next(r for r in self.running if r.rid == rid))
            self.abort(rid)
        return finished

    def _register_tail(self, req: _Req) -> None:
        """A finished request's partly written last block becomes a leaf of
        the tree too (the state at a prompt's end inside it is worth nothing
        without it); a later hit inside it copies it."""
        B, n = self.B, req.computed
        prefix = tuple(req.tokens[:n])
        if n % B and req.shared == n // B and len(req.blocks) > n // B and prefix not in self.nodes:
            block = req.blocks[n // B]
            self.nodes[prefix] = _Node(block, used=self._tick())
            self.block_of[block] = prefix
            if n > B:
                self.nodes[prefix[: n // B * B]].children += 1
            req.shared += 1

    def _register_blocks(self, req: _Req, now: int) -> None:
        """Each block the request completed becomes a node (unless the tree has that prefix already)."""
        B = self.B
        for k in range(req.shared, req.computed // B):
            prefix = tuple(req.tokens[: (k + 1) * B])
            if prefix in self.nodes or (k and prefix[:-B] not in self.nodes):
                break  # another request's node (this block stays the request's own), or no parent
            self.nodes[prefix] = _Node(req.blocks[k], used=now)
            self.block_of[req.blocks[k]] = prefix
            if k:
                self.nodes[prefix[:-B]].children += 1
            req.shared = k + 1

    def abort(self, rid: str) -> None:
        req = next((r for r in self.waiting + self.running if r.rid == rid), None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self.running.remove(req)
        for b in req.blocks:
            self._release_block(b)
        for s in req.pins + ([req.slot] if req.slot is not None else []):
            self._release_slot(s)
        for b in req.kv_pins:
            self._release_block(b)
        req.blocks, req.pins, req.kv_pins, req.slot = [], [], [], None

    def view(self) -> CacheView:
        return CacheView(kv_refcounts=dict(enumerate(self.kv_ref)),
                         state_refcounts=dict(enumerate(self.state_ref)),
                         cached_kv=tuple(CachedKV(b, p) for b, p in self.block_of.items()),
                         cached_states=tuple(CachedState(s, p) for s, p in self.slot_of.items()),
                         running=tuple(r.rid for r in self.running))


class PromptEndRadixCache(RadixCache):
    """(b) The state at each prompt's end only, nowhere else."""

    name = "radix-prompt-end"
    prompt_end_only = True


class PagedRadixCache(RadixCache):
    """Rounds every chunk up to the block's end (SGLang cuts a chunk to whole
    pages): a chunk never ends inside a block, nor is one shorter than the
    conv window after a hit (the budget is a bound a cache may round)."""

    name = "radix-paged"

    def _chunk(self, req: _Req, budget: int) -> int:
        return -(-(req.computed + max(budget, 1)) // self.B) * self.B - req.computed if budget > 0 else 0
