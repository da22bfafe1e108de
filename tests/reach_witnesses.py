"""Witness caches of issue 37: each is the reference with one bug an outside
cache had, which only one history the generator did not build before
catches (``tests/test_reach.py``; their catch at seeds 0-9 in
docs/hard-histories.md).  Each bug is one small override, as a cache author
would write it; none crashes on its own (a crash would be the bug's catch,
not the suite's).

Run one through the suite with ``PYTHONPATH=tests hybrid-conformance run
--impl reach_witnesses:HitLeftInFreeQueue --check pressure-while-running``.
"""

from __future__ import annotations

from conformance.adapters.reference import ReferenceCache
from conformance.adapters.reference.block_pool import ROOT, BlockPool, chain
from conformance.adapters.reference.cache import Match
from conformance.adapters.reference.speculative import SpecOptions
from conformance.contract import RequestStep, StepPlan


# -- a: the pool exhausted down to a block a live prefix hit holds ------------------------------
class _HitStaysQueued(BlockPool):
    def acquire(self, ident: int) -> None:
        self.ref[ident] += 1
        if ident in self.free:
            self.free.move_to_end(ident)  # the bug: a hit refreshes the block in the free queue, not takes it

    def release(self, ident: int) -> None:
        self.ref[ident] = max(0, self.ref[ident] - 1)  # (never below zero: the bug is not its own crash)
        if self.ref[ident] == 0:
            self.free[ident] = None
            if self.content(ident) is None:
                self.free.move_to_end(ident, last=False)


class HitLeftInFreeQueue(ReferenceCache):
    """A prefix hit takes its cached blocks without removing them from the
    free queue (it refreshes them there, as the most recently used): only an
    allocation that needs every free block and every cached one the hit is
    younger than reaches them, and hands one to a new prompt while the hit's
    request still reads it."""

    name = "witness-a-hit-left-in-free-queue"

    def __init__(self, config=None):
        super().__init__(config)
        self.kv = _HitStaysQueued(self.config.num_kv_blocks)


# -- b: different prefixes that continue with the same block content ---------------------------
class SightingsByLastBlock(ReferenceCache):
    """Second-hit sightings keyed by the checkpoint's last block of tokens,
    not by the whole prefix: a prefix whose last block another prefix ended
    with is admitted on its first sighting."""

    name = "witness-b-sightings-by-last-block"

    def _key(self, prefix) -> tuple[int, ...]:
        return tuple(prefix[-self.B:])

    def _should_admit(self, prefix):
        if self.policy.admission == "always":
            return True
        return self.sightings.see(self._key(prefix)) >= 2

    def _sighted(self, req, pos):
        return self.policy.admission == "second-hit" and self._key(req.tokens[:pos]) in self.sightings.counts


# -- c: a request that finishes on a verification that discarded drafts -------------------------
class EndStateAfterAllDrafts(ReferenceCache):
    """The state at a sequence's end is registered at the accepted length, but
    where the verification ended the request it is taken from the column after
    every draft (the last one computed), not from the accepted one."""

    name = "witness-c-end-state-after-all-drafts"

    def _verified(self, req, step, accepted, sampled):
        super()._verified(req, step, accepted, sampled)
        if step.draft_slots and req.resume_slot is not None and req.generated + (sampled is not None) >= req.max_new:
            req.resume_slot = step.draft_slots[-1]  # the bug: the last column, whatever was accepted


# -- d: a block opened only by a wholly rejected last draft --------------------------------------
class LeakWhenLastDraftOpenedBlock(ReferenceCache):
    """Two drafts a step.  After a verification that accepted nothing, a block
    that only its last draft opened is dropped from the request's table
    without being released (a leak: the path that frees a rejected tail
    forgets that case)."""

    name = "witness-d-leak-when-last-draft-opened-block"

    def __init__(self, config=None):
        super().__init__(config)
        if self.spec.tokens:  # two drafts a step (the outside cache's; with three its leak shows more often)
            self.spec = SpecOptions(2, self.spec.scheme, self.spec.drop_block)

    def _verified(self, req, step, accepted, sampled):
        super()._verified(req, step, accepted, sampled)
        k = len(step.drafts)
        last = (step.end + k - 1) // self.B
        if accepted == 0 and k >= 2 and (step.end + k - 1) % self.B == 0 and last > step.end // self.B \
                and len(req.blocks) == last + 1:
            req.blocks.pop()  # the bug: dropped, never released


# -- e: an abort after a verification --------------------------------------------------------------
class RollbackSlotLeakOnAbort(ReferenceCache):
    """The rollback scheme: the slot that snapshots the state before the
    drafts is allocated at a request's first verification; an abort frees the
    request's blocks and running slot and forgets it."""

    name = "witness-e-rollback-slot-leak-on-abort"

    def __init__(self, config=None):
        super().__init__(config)
        if self.spec.tokens:
            self.spec = SpecOptions(self.spec.tokens, "rollback", self.spec.drop_block)

    def abort(self, request_id):
        req = self._find(request_id)
        req.spare = []  # the bug: the rollback slot is not the request's in this path
        super().abort(request_id)


# -- f: a same-step hit on KV another request's verification writes -------------------------------
class DraftKVListedAtSchedule(ReferenceCache):
    """Running requests are planned first and waiting ones admitted after
    them (vLLM's order); a verification's blocks that its drafts complete are
    listed as reusable from ``schedule()`` on, under the drafts' tokens, and
    registered again by the accepted length at ``update()`` (vllm#47930's
    family: draft KV shareable before acceptance)."""

    name = "witness-f-draft-kv-listed-at-schedule"

    def __init__(self, config=None):
        super().__init__(config)
        self.listed_drafts: list[int] = []

    def schedule(self, budget):
        steps: list[RequestStep] = []
        copies: list[tuple[int, int]] = []
        for req in list(self.running):
            if budget <= 0:
                break
            step = self._plan_request(req, budget)
            if step is not None:
                steps.append(step)
                budget -= step.end - step.start
        for req in list(self.waiting):
            if self._admit(req, copies):
                self.waiting.remove(req)
                self.running.append(req)
                if budget > 0:
                    step = self._plan_request(req, budget)
                    if step is not None:
                        steps.append(step)
                        budget -= step.end - step.start
        return StepPlan(requests=tuple(steps), kv_copies=tuple(copies))

    def _plan_request(self, req, budget):
        step = super()._plan_request(req, budget)
        if step is not None and step.drafts:
            B, seq, parent = self.B, req.tokens + list(step.drafts), ROOT
            for i in range((step.end + len(step.drafts)) // B):
                tokens = tuple(seq[i * B: (i + 1) * B])
                if i >= step.end // B and req.blocks[i] not in self.kv.meta:
                    self.kv.register(parent, tokens, tuple(seq[: (i + 1) * B]), req.blocks[i])
                    self.listed_drafts.append(req.blocks[i])  # the bug: listed before the verifier decided
                parent = chain(parent, tokens)
        return step

    def update(self, plan, result):
        for b in self.listed_drafts:
            self.kv.unregister(b)
        self.listed_drafts = []
        return super().update(plan, result)


# -- g: requests that wait -----------------------------------------------------------------------
class MatchAtArrival(ReferenceCache):
    """The prefix is matched when a request arrives; it is admitted once the
    pool has room for its prompt, with what was matched then, not held in
    between: a request that waited while the pool was busy takes blocks and
    a state that were evicted and reused meanwhile."""

    name = "witness-g-match-at-arrival"

    def __init__(self, config=None):
        super().__init__(config)
        self.stale: Match | None = None

    def add_request(self, request):
        super().add_request(request)
        req = self.waiting[-1]
        req.arrival = self._match(req.tokens[: req.prompt_len])  # the bug: matched, not held

    def _admit(self, req, kv_copies):
        m = req.arrival
        need = -(-req.prompt_len // self.B) - len(m.blocks) + (1 if m.length % self.B else 0)
        if self.kv.num_free() < need:
            return False  # waits for room (vLLM allocates a prompt's blocks when it admits it)
        self.stale = Match(m.length, list(m.blocks), m.slot)
        try:
            return super()._admit(req, kv_copies)
        finally:
            self.stale = None

    def _match(self, prompt):
        if self.stale is not None:
            return self.stale
        return super()._match(prompt)


# -- h: an abort right after a copy-on-write hit, before its first chunk -----------------------------
class FirstChunkToBlockEndLeaksCopy(ReferenceCache):
    """A hit's first chunk runs to the end of the block it copied (whatever
    the budget); a copy-on-write block is tracked apart until the request
    completes it, and an abort before that forgets it (a leak).  In this
    design the copy is incomplete only between the step that admitted the
    request and its first chunk."""

    name = "witness-h-first-chunk-to-block-end-leaks-copy"

    def _admit(self, req, kv_copies):
        ok = super()._admit(req, kv_copies)
        req.copied = req.computed // self.B if ok and req.computed % self.B else None
        return ok

    def _plan_request(self, req, budget):
        i = getattr(req, "copied", None)
        if i is not None and req.computed < (i + 1) * self.B:
            budget = max(budget, min((i + 1) * self.B, req.prompt_len) - req.computed)
        step = super()._plan_request(req, budget)
        if step is not None and i is not None and step.end >= min((i + 1) * self.B, req.prompt_len):
            req.copied = None  # the copy is complete once this step ran
        return step

    def abort(self, request_id):
        req = self._find(request_id)
        i = getattr(req, "copied", None)
        if i is not None and req in self.running:
            req.blocks = req.blocks[:i] + req.blocks[i + 1:]  # the bug: the copy is forgotten
        super().abort(request_id)


WITNESSES = {"a": HitLeftInFreeQueue, "b": SightingsByLastBlock, "c": EndStateAfterAllDrafts,
             "d": LeakWhenLastDraftOpenedBlock, "e": RollbackSlotLeakOnAbort, "f": DraftKVListedAtSchedule,
             "g": MatchAtArrival, "h": FirstChunkToBlockEndLeaksCopy}

# the check of the quick profile whose history catches each (its --check run draws what the profile draws)
CAUGHT_BY = {"a": "pressure-while-running", "b": "retention-policy", "c": "spec-decode", "d": "spec-decode",
             "e": "spec-decode", "f": "spec-decode", "g": "kv-scarce", "h": "mid-block-hits"}

