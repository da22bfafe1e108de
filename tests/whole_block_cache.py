"""A correct whole-block cache written from the README's contract alone (issue 21, b).

It reuses whole blocks only, keeps the recurrent state at every block boundary
a step computes through (``{"interval": None, "admission": "always",
"prompt_ends": False}``), and computes a prompt in as few steps as the budget
allows: the boundaries inside a step are ``snapshots`` into spare slots, the
boundary a step ends on is registered in place (the running slot is handed
over to the cache and the request continues from a copy in a fresh slot).
When spare slots run out it keeps the deepest boundaries of the step and
evicts the least recently used cached states of earlier steps, never one of
its own step.  Refcounts count requests, pending copy sources and the slots
a step is about to write, until ``update()``.
"""

from __future__ import annotations

from collections import OrderedDict
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


class _Pool:
    """Refcounted ids; free ones holding cached content are evicted least recently used first."""

    def __init__(self, n: int):
        self.ref = [0] * n
        self.key: dict[int, tuple[int, ...]] = {}  # id -> the prefix its content is cached for
        self.index: dict[tuple[int, ...], int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced
        self.empty = list(range(n))[::-1]  # free, caching nothing

    def take(self, avoid: set[int] = frozenset()) -> int | None:
        if self.empty:
            i = self.empty.pop()
        else:
            i = next((j for j in self.lru if j not in avoid), None)
            if i is None:
                return None
            del self.lru[i]
            del self.index[self.key.pop(i)]
        self.ref[i] = 1
        return i

    def hold(self, i: int) -> None:
        self.ref[i] += 1
        self.lru.pop(i, None)

    def drop(self, i: int) -> None:
        self.ref[i] -= 1
        assert self.ref[i] >= 0
        if self.ref[i] == 0:
            if i in self.key:
                self.lru[i] = None
            else:
                self.empty.append(i)

    def register(self, prefix: tuple[int, ...], i: int) -> bool:
        if prefix in self.index or i in self.key:
            return False
        self.index[prefix], self.key[i] = i, prefix
        return True

    def free_or_evictable(self) -> int:
        return len(self.empty) + len(self.lru)


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    generated: int = 0
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    init: StateInit = FRESH
    pins: list[int] = field(default_factory=list)  # state slots held until the step ran
    snaps: list[tuple[int, int]] = field(default_factory=list)  # this step's snapshot (position, slot)


class WholeBlockCache:
    name, version = "whole-block", "0.1"
    hand_over = True  # register the state a step ends on in its running slot (False: a test's weaker cache)

    def __init__(self, config: ImplConfig):
        self.B = config.block_size
        self.kv = _Pool(config.num_kv_blocks)
        self.states = _Pool(config.num_state_slots)
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []

    def layout(self) -> Layout:
        return Layout(self.B, len(self.kv.ref), len(self.states.ref))

    def retention(self) -> dict:
        return {"interval": None, "admission": "always", "prompt_ends": False}

    def add_request(self, r) -> None:
        self.waiting.append(_Req(r.request_id, list(r.prompt), len(r.prompt), r.max_new_tokens))

    # -- admission ------------------------------------------------------------------------
    def _match(self, prompt: list[int]) -> tuple[int, list[int], int | None]:
        """The longest whole-block prefix (one token left to compute) whose blocks and state are cached."""
        B, best, blocks = self.B, (0, [], None), []
        for k in range(1, (len(prompt) - 1) // B + 1):
            block = self.kv.index.get(tuple(prompt[: k * B]))
            if block is None:
                break
            blocks.append(block)
            slot = self.states.index.get(tuple(prompt[: k * B]))
            if slot is not None:
                best = (k * B, list(blocks), slot)
        return best

    def _admit(self, req: _Req) -> bool:
        length, blocks, source = self._match(req.tokens[: req.prompt_len])
        for b in blocks:
            self.kv.hold(b)
        if source is not None:
            self.states.hold(source)
        slot = self.states.take()
        if slot is None:
            for b in blocks:
                self.kv.drop(b)
            if source is not None:
                self.states.drop(source)
            return False
        req.blocks, req.slot, req.computed = blocks, slot, length
        if source is None:
            req.init = FRESH
        else:
            req.init = copy_from(source)
            req.pins.append(source)
        return True

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, budget: int) -> StepPlan:
        for req in list(self.waiting):
            if not self._admit(req):
                break
            self.waiting.remove(req)
            self.running.append(req)
        steps = []
        for req in self.running:
            n = min(len(req.tokens) - req.computed, budget)
            if n <= 0:
                continue
            step = self._plan(req, req.computed + n)
            if step is not None:
                steps.append(step)
                budget -= n
        return StepPlan(tuple(steps))

    def _plan(self, req: _Req, end: int) -> RequestStep | None:
        need = -(-end // self.B) - len(req.blocks)
        if need > self.kv.free_or_evictable():
            return None
        if req.slot is None:  # the last slot was handed over to the cache: continue from a copy
            req.slot = self.states.take(avoid=set(req.pins))
            if req.slot is None:
                return None
        for _ in range(need):
            req.blocks.append(self.kv.take())
        B, mine = self.B, set()
        for q in range((end - 1) // B * B, req.computed, -B):  # the deepest boundaries inside the step first
            if tuple(req.tokens[:q]) in self.states.index:
                continue
            slot = self.states.take(avoid=mine | set(req.pins))
            if slot is None:
                break
            mine.add(slot)
            req.snaps.append((q, slot))
        init, req.init = req.init, RESUME
        return RequestStep(req.rid, req.computed, end, tuple(req.blocks), req.slot, init,
                           snapshots=tuple(sorted(req.snaps)))

    def update(self, plan, result) -> list[str]:
        finished = []
        for rs in plan.requests:
            req = next(r for r in self.running if r.rid == rs.request_id)
            req.computed = rs.end
            for s in req.pins:
                self.states.drop(s)
            req.pins = []
            for q, slot in req.snaps:
                self.states.register(tuple(req.tokens[:q]), slot)
                self.states.drop(slot)
            req.snaps = []
            for i in range(rs.end // self.B):  # full blocks become reusable
                self.kv.register(tuple(req.tokens[: (i + 1) * self.B]), req.blocks[i])
            if self.hand_over and rs.end % self.B == 0 and self.states.register(tuple(req.tokens[: rs.end]), req.slot):
                req.pins.append(req.slot)  # handed over: the request's hold is now the copy's pin
                req.init, req.slot = copy_from(req.slot), None
            if rs.request_id in result.sampled:
                req.tokens.append(result.sampled[rs.request_id])
                req.generated += 1
                if req.generated >= req.max_new:
                    finished.append(req.rid)
        for rid in finished:
            self.abort(rid)
        return finished

    def abort(self, rid: str) -> None:
        req = next((r for r in self.waiting + self.running if r.rid == rid), None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self.running.remove(req)
        for b in req.blocks:
            self.kv.drop(b)
        for s in req.pins + ([req.slot] if req.slot is not None else []):
            self.states.drop(s)

    def view(self) -> CacheView:
        return CacheView(kv_refcounts=dict(enumerate(self.kv.ref)),
                         state_refcounts=dict(enumerate(self.states.ref)),
                         cached_kv=tuple(CachedKV(b, p) for b, p in self.kv.key.items()),
                         cached_states=tuple(CachedState(s, p) for s, p in self.states.key.items()),
                         running=tuple(r.rid for r in self.running))
