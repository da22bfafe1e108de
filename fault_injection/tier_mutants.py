"""Seeded bugs in the reference cache's second tier (issue 14): how the
local and the remote tier are compared and reconciled, and how loads are
awaited.  Each needs the tier on (``options``), and must be caught by the
general suite (the ``tier-races`` check, its expected-hit oracle, the logits
and the invariants), never by a check written for it."""

from __future__ import annotations

from dataclasses import replace

from conformance.adapters.reference.cache import Match, ReferenceCache
from fault_injection.registry import register, subclass_mutant

TIER = {"host_tier": True}


def _subclass(factory, name: str, **methods):
    return subclass_mutant(ReferenceCache, factory, name, **methods)


def _admit_remembering(cache, req, kv_copies):
    """``_admit`` that remembers which request is being matched (the tier's
    per-request records are keyed by it), for the mutants' ``_tier_match``."""
    cache._current = req.request_id
    return ReferenceCache._admit(cache, req, kv_copies)


def _remote_match(cache, prompt, remote: int, slot) -> Match:
    """KV blocks for ``remote`` tokens from the device chain, state from ``slot``."""
    _kv_len, blocks, _keys = cache._match_kv(prompt)
    return Match(remote, blocks[: -(-remote // cache.B)], slot)


@register("tier-block-granular", "HIT", options=TIER)
def tier_block_granular(factory):
    """The tiers are compared in whole blocks: a local hit that ends inside a
    block is rounded down before the comparison, so a remote prefix as long as
    the rounded hit wins, and the request reuses only that (the design note's
    2,047 tokens rounded to 1,984)."""

    def _remote_wins(self, local, remote):
        return remote >= local // self.B * self.B

    def _tier_match(self, prompt, match, remote):
        slot = self.states.lookup(tuple(prompt[:remote]))
        return _remote_match(self, prompt, remote, slot) if slot is not None else match

    return _subclass(factory, "tier-block-granular", _remote_wins=_remote_wins, _tier_match=_tier_match)


@register("tier-tail-not-released", "LIFETIME", options=TIER)
def tier_tail_not_released(factory):
    """When the remote tier wins, the block reserved for the shorter local
    hit's partial tail is never given back: it leaks."""

    def _remote_won(self, block):
        return None

    return _subclass(factory, "tier-tail-not-released", _remote_won=_remote_won)


@register("tier-groups-unreconciled", "GROUPS", options=TIER)
def tier_groups_unreconciled(factory):
    """When the remote tier wins, the attention group moves to the remote
    length but the recurrent group keeps the local hit's snapshot (or none):
    one group is not reconciled to the new prefix length."""

    def _tier_match(self, prompt, match, remote):
        local, _ = self.tier.compared.get(self._current, (0, remote))
        slot = self.states.lookup(tuple(prompt[:local])) if local else None
        return _remote_match(self, prompt, remote, slot)

    return _subclass(factory, "tier-groups-unreconciled", _tier_match=_tier_match, _admit=_admit_remembering)


@register("tier-state-other-length", "GROUPS", options=TIER)
def tier_state_other_length(factory):
    """KV from one tier with the state from another length: the request
    keeps the local tier's KV length but starts from the state the remote
    tier loaded (at the remote length)."""

    def _tier_match(self, prompt, match, remote):
        local, _ = self.tier.compared.get(self._current, (0, remote))
        slot = self.states.lookup(tuple(prompt[:remote]))
        if slot is None or local == remote:
            return match
        _kv_len, blocks, _keys = self._match_kv(prompt)
        return Match(local, blocks[: -(-local // self.B)], slot)

    return _subclass(factory, "tier-state-other-length", _tier_match=_tier_match, _admit=_admit_remembering)


@register("tier-load-not-awaited", "LIFETIME", options=TIER)
def tier_load_not_awaited(factory):
    """A request is admitted as soon as its loads are issued, on the blocks
    and the slot they are loading into, without waiting for their
    completions: right only when every load lands in the same step."""

    def _waits_for_loads(self, request_id):
        return False

    def _tier_match(self, prompt, match, remote):
        planned = self.tier.destinations.get(self._current)
        if planned is None or planned[1] is None:
            return match
        blocks, slot = planned
        return Match(remote, list(blocks[: -(-remote // self.B)]), slot)

    return _subclass(factory, "tier-load-not-awaited", _waits_for_loads=_waits_for_loads,
                     _tier_match=_tier_match, _admit=_admit_remembering)


@register("exact-multiple-loses-prompt-end", "HIT")
def exact_multiple_loses_prompt_end(factory):
    """When the prompt is an exact multiple of the block size, the state at
    its end is not kept (the prompt-end checkpoint and the last block
    boundary coincide and each path leaves it to the other): a later turn
    that replays the prompt loses a block of reuse."""

    def _register_snapshot(self, req):
        if req.computed == req.prompt_len and req.prompt_len % self.B == 0:
            req.offered = req.computed
            return
        ReferenceCache._register_snapshot(self, req)

    return _subclass(factory, "exact-multiple-loses-prompt-end", _register_snapshot=_register_snapshot)


@register("tier-offload-after-overwrite", "TIER", options=TIER)
def tier_offload_after_overwrite(factory):
    """The offload of an evicted entry is issued in the plan after the one
    whose allocation evicted it (a write-back queue drained one step late):
    by then the step has overwritten the block or slot, so the host stores
    the new occupant's bytes under the evicted prefix's key, with their own
    checksum, and a later load brings another prompt's KV or state back as
    that prefix's (TRT-LLM#8813: tokens from other prompts)."""

    def schedule(self, budget):
        plan = ReferenceCache.schedule(self, budget)
        late, self._late = getattr(self, "_late", ()), tuple(t for t in plan.transfers if t.direction == "offload")
        return replace(plan, transfers=tuple(t for t in plan.transfers if t.direction != "offload") + late)

    return _subclass(factory, "tier-offload-after-overwrite", schedule=schedule)
