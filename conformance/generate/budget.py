"""The generator's budget: what it may ask of a cache's pools, and what a
check's histories need of them (and of the block size).

The generator submits a request only while the active ones together need at
most ``ceil((prompt + max_new_tokens) / B) + 1`` KV blocks each and two state
slots each (two more per draft with speculative decoding on) within the pool
(:meth:`MachineBase.fits`), so that a correct cache never has to refuse work.
A pool the user makes smaller (``--kv-blocks``, ``--state-slots``) can leave a
history out of that budget: two requests at once never fit, or no request
that could reuse anything.  Such a check is not failed on coverage for it:
:func:`pool_limits` says which counters the pool rules out (excused, with a
note) and when a check cannot run at all (skipped, with the reason), and the
run says both before its first check.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.contract import ImplConfig
from conformance.generate.spec import CheckSpec


def blocks_for(length: int, max_new: int, block_size: int) -> int:
    """KV blocks the budget sets aside for one request (its sequence and one more)."""
    return -(-(length + max_new) // block_size) + 1


def slots_for(max_drafts: int = 0) -> int:
    """State slots the budget sets aside for one request: its running state
    and a snapshot, and one per draft it may verify."""
    return 2 + max_drafts


# Counters of histories that need two requests active at once: several cold
# prefills of one prefix in one step; an eviction past a running request's
# entry, made by another's allocations; a verification beside another
# request's chunk; a second request for a prefix being loaded; a request that
# waits while others run (issue 37).
TOGETHER = ("same_step_cold_prefills", "evictions_past_running_entry", "verify_beside_chunked_prefill",
            "claims_while_loading", "waits_while_busy")


# Counters of positions inside a block: none exists where a block is one token.
INSIDE_A_BLOCK = ("mid_block_hits", "aborts_before_copied_block_complete", "mid_block_chunks_after_mid_block_hit",
                  "mid_block_chunk_ends", "in_block_divergences", "tail_divergences", "divergences_inside_held_block",
                  "aborts_mid_prefill_after_mid_block_hit", "mid_block_local_vs_remote",
                  "tier_hits_over_mid_block_local")


@dataclass(frozen=True)
class PoolLimits:
    skip: str | None  # why no history of the check fits the pool at all (the check is skipped)
    excused: dict[str, str]  # counter -> why the pool rules it out


def pool_limits(spec: CheckSpec, config: ImplConfig, max_drafts: int = 0) -> PoolLimits:
    """What the generator's budget leaves of the check's histories in this
    pool.  A reuse needs a prompt past its first block (B + 1 tokens) and a
    token to generate; two cold prefills of one prefix, a prompt of two
    blocks each."""
    B, kv, slots = config.block_size, config.num_kv_blocks, config.num_state_slots
    need_slots = slots_for(max_drafts)
    reuse = blocks_for(B + 1, 1, B)
    if slots < need_slots:
        return PoolLimits(f"the pool is too small for any request of this check: the generator's budget sets "
                          f"{need_slots} state slots aside for each (its running state and a snapshot"
                          + (f", and one per draft: {max_drafts}" if max_drafts else "") + f"), and the pool has "
                          f"{slots}", {})
    if kv < reuse:
        return PoolLimits(f"the pool is too small for a request that could reuse anything: the generator's budget "
                          f"sets {reuse} KV blocks aside for a prompt past its first block, and the pool has {kv}",
                          {})
    geometry = {}
    if B == 1:  # every position is a block boundary (SGLang's page 1)
        geometry.update({c: f"{c} was not asked for: with blocks of 1 token no position lies inside a block"
                         for c in INSIDE_A_BLOCK if c in spec.required})
    elif B == 2:
        # a hit inside a 2-token block ends one token before the block's end: the first token
        # computed completes the copy, and no abort can come between; and a partial tail is one
        # token long, so no prompt diverges one token into it and still inside it
        short = {"aborts_before_copied_block_complete": "a hit inside a block ends one token before its end, "
                                                        "which the request's first computed token completes",
                 "tail_divergences": "a sequence's partial last block holds one token, and no prompt parts from "
                                     "it one token into it and still inside it"}
        geometry.update({c: f"{c} was not asked for: with blocks of 2 tokens {w}" for c, w in short.items()
                         if c in spec.required})
    two = 2 * blocks_for(2 * B, 2, B)
    if spec.max_active < 2 or slots < 2 * need_slots or kv < two:
        why = (f"two requests at once never fit the generator's budget in this pool ({kv} KV blocks, {slots} "
               f"state slots; two requests of two blocks need {two} blocks and {2 * need_slots} slots)")
        return PoolLimits(None, {**geometry, **{c: f"{c} was not asked for: {why}" for c in TOGETHER
                                                if c in spec.required}})
    return PoolLimits(None, geometry)


def warnings(checks, configs, max_drafts) -> list[str]:
    """One line per check whose pool leaves a history out (before the run's
    first check): ``checks`` and ``configs`` in the plan's order,
    ``max_drafts(spec)`` the drafts a request of that check may verify."""
    out = []
    for spec, config in zip(checks, configs, strict=True):
        limits = pool_limits(spec, config, max_drafts(spec))
        if limits.skip:
            out.append(f"warning: {spec.id} will be skipped: {limits.skip}")
        elif limits.excused:
            out.append(f"warning: {spec.id}: " + "; ".join(limits.excused.values()))
    return out
