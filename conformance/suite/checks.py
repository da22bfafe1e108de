"""The checks of the suite: one state machine, configured per family, and the
coverage each must reach (a run in which a family's situation never occurred
fails: a check that exercised nothing proves nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.generate.spec import CheckSpec, mixed

CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("mid-block-hits", "mid-block",
              "prompts cut from shared prefixes at k*B-1, k*B, k*B+1 and mid-block; hits that end inside a block",
              frozenset({"continue", "abort-copy"}),
              ("prefix_hits", "mid_block_hits", "aborts_before_copied_block_complete",
               "mid_block_chunks_after_mid_block_hit", "short_chunks_from_snapshot")),
    CheckSpec("multi-turn-replay", "multi-turn",
              "continuations that replay the previous prompt and output, then add a turn",
              frozenset({"continue", "step"}), ("multi_turn_hits", "decode_steps")),
    CheckSpec("chunked-prefill", "chunked-prefill",
              "per-step token budgets whose chunk ends split blocks, interleaved with other requests",
              frozenset({"step", "continue"}), ("chunked_prefills", "mid_block_chunk_ends", "prefix_hits")),
    CheckSpec("eviction-pressure", "eviction",
              "a small pool: distinct long prompts force cached blocks and snapshots out while others reuse",
              frozenset({"pressure", "continue", "step"}), ("evictions", "hits_after_eviction"),
              num_kv_blocks=28, num_state_slots=10, max_seq_blocks=8, max_active=2),
    CheckSpec("snapshot-reuse", "snapshot",
              "recurrent snapshots reused across requests, with aborts and decode in between",
              frozenset({"abort", "step", "continue"}), ("snapshot_reuse", "aborts")),
    # Eviction pressure with the second tier on: what a small device pool
    # evicts comes back through loads (faults and tier mutants meet it here).
    CheckSpec("tier-reuse", "tier",
              "a small device pool spills to the second tier; later requests load back what was evicted",
              frozenset({"pressure", "continue", "step", "tier-tail"}),
              ("tier_loads", "tier_hits", "tier_hits_over_local"),
              num_kv_blocks=28, num_state_slots=10, max_seq_blocks=8, max_active=2, tier=True),
    # The declared retention policy (default here: interval 8 and second-hit
    # together; --option overrides).  Reusing less than promised is a
    # performance bug, so it is its own family: "hit-rate".
    CheckSpec("retention-policy", "retention",
              "states cached only at declared checkpoints; second-hit admission never admits a first sighting",
              frozenset({"continue", "step", "reconverge"}),
              ("checkpoints_offered", "admissions", "reconverged_blocks"),
              options={"interval": 8, "admission": "second-hit"}, observe=("retention",)),
    CheckSpec("retention-hit-rate", "hit-rate",
              "every checkpoint the declared policy admits is cached, and lookups reuse the longest cached prefix",
              frozenset({"continue", "step"}), ("checkpoints_offered", "state_lookups", "prefix_hits"),
              options={"interval": 8}, observe=("hit-rate",)),
    # Prefill on one worker, decode on another, heterogeneous layouts, a real
    # transfer between them (NIXL when it imports); see conformance/suite/disagg.py.
    CheckSpec("disagg-transfer", "disagg",
              "prefill/decode disaggregation: prompts ending on, beside and inside blocks, both layout pairings, "
              "prefix hits before transfer, decode continuing while other transfers are in flight",
              frozenset(), ("pairing_2to1", "pairing_1to2", "mid_block_prompt_ends", "state_shards_transferred",
                            "transfers_verified", "prefill_hits", "in_flight_reuse"), disagg=True),
    # Appended after the original checks: a check's seed comes from its index
    # in the profile, so the ones above keep their draws (a regression baseline).
    # The hard histories of issue 14, each group with the coverage it must reach.
    # 20 KV blocks: where one pool holds KV and states (vLLM) it is the whole
    # pool, and a longest sequence (10 blocks of KV, 3 of Mamba state) leaves
    # room for one more; at 28 that pool turned over in few examples (2
    # evictions while running in the quick profile against the reference's
    # 141, all of them state evictions there).  The live-pressure prompts
    # stay 39 tokens long (max_seq_blocks bounds them, not the pool).
    CheckSpec("pressure-while-running", "eviction",
              "distinct long prompts arrive while others are mid-prefill and mid-decode; running requests abort",
              frozenset({"live-pressure", "live-abort", "step", "continue", "evict-running"}),
              ("evictions_while_running", "aborts_mid_prefill", "aborts_mid_decode", "prefix_hits",
               "cached_overwritten_while_running", "evictions_past_running_entry"),
              num_kv_blocks=20, num_state_slots=10, max_seq_blocks=10, max_new_tokens=8),
    CheckSpec("hard-prefixes", "mid-block",
              "one cold prefix many times in one step; A->B->A; prompts diverging at every offset inside a block",
              frozenset({"burst", "aba", "diverge", "step"}),
              ("same_step_cold_prefills", "aba_rerequests", "in_block_divergences", "tail_divergences",
               "aba_displaced", "divergences_inside_held_block"),
              num_kv_blocks=32, num_state_slots=12, max_seq_blocks=8, observe=("expected-hit",)),
    CheckSpec("kv-scarce", "eviction",
              "KV blocks scarcer than state slots: cached KV evicted under running requests",
              frozenset({"live-pressure", "burst", "step", "continue", "kv-first", "wait"}),
              ("evictions_while_running", "prefix_hits", "cached_overwritten_while_running", "state_outlives_kv",
               "waits_while_busy"),
              num_kv_blocks=14, num_state_slots=24, max_prompt_blocks=3, max_seq_blocks=6, max_active=2),
    # 24 KV blocks, four times the state slots: where one pool holds KV and
    # states (vLLM) slot pressure is pool pressure, and a pool of 64 never
    # filled within an example of the quick profile there (no eviction, no
    # snapshot hit under pressure); the reference's KV never binds at 24 either.
    CheckSpec("slots-scarce", "snapshot",
              "state slots scarcer than KV: snapshot hits compete with new snapshots in one schedule",
              frozenset({"burst", "diverge", "step", "continue"}), ("snapshot_hits_under_slot_pressure",),
              num_kv_blocks=24, num_state_slots=6, max_active=2),
    # The host tier's wire under Hypothesis's control: completions held,
    # delayed, failed, delivered short or out of order, the host entry evicted
    # after the lookup, the prefix claimed again or the request aborted while
    # its load is in flight.  remote_expected: admissions whose expectation
    # only the host tier could meet (the expected-hit oracle judged the tier's
    # part at least once; an implementation that declares no tier unit is
    # never judged there, and fails this coverage).
    CheckSpec("tier-races", "tier",
              "loads completing late, out of order, failed or short, racing local and remote eviction and aborts",
              frozenset({"transfers", "aba", "diverge", "step", "turn-over"}),
              ("tier_loads", "loads_held", "store_evicted_during_load", "remote_expected"),
              num_kv_blocks=28, num_state_slots=10, max_seq_blocks=8, max_active=2, tier=True,
              observe=("expected-hit",)),
    # Speculative decoding (issue 22), with the implementation's own setting
    # (its spec_option): drafts proposed by the harness, verified, accepted by
    # the oracle; a pool small enough that verification meets eviction
    # (two requests with k spare state slots each fill 12 slots).
    CheckSpec("spec-decode", "spec",
              "draft tokens verified against recurrent state: partial acceptance and rollback, zero-draft steps after "
              "accepted ones, drafts across blocks, hits and snapshots after verification, aborts, pressure",
              frozenset({"spec", "continue", "step"}),
              ("drafts_rejected_all", "drafts_accepted_partial", "drafts_accepted_all", "zero_draft_after_accept",
               "drafts_across_block", "hits_after_verify", "snapshots_after_verify", "aborts_with_drafts",
               "verify_under_pressure", "verify_beside_chunked_prefill", "aborts_after_verify"),
              num_kv_blocks=32, num_state_slots=12, max_seq_blocks=10, max_active=2, max_new_tokens=12, spec=True,
              observe_when_declared=("expected-hit",)),
    # Sliding-window KV, the third memory shape (issue 35), on a model with
    # window layers of two windows beside a recurrent and a full attention
    # layer (fixtures/models/window-hybrid.toml); counters: judge/windows.py.
    CheckSpec("window-reuse", "window",
              "prompts longer than the window, hits past the window after its blocks were freed, prompts extended "
              "inside the last block, chunked prefill across the window, aborts mid-window",
              frozenset({"continue", "step", "abort", "window-freed"}),
              ("prefix_hits", "window_prompts_past_window", "window_chunks_across", "window_hits_past_freed",
               "window_extended_hits", "window_aborts_mid_window"),
              num_kv_blocks=36, num_state_slots=24, max_prompt_blocks=4, max_seq_blocks=9, max_active=2,
              model="window-hybrid"),
    # Drafts verified against window layers: a rejected draft rolls the
    # window's start back below where an optimistic free would have left it
    # (vllm#47728); EAGLE's dropped block (spec_drop_block) moves a hit left
    # of the window its finder held (vllm#17398).
    CheckSpec("window-spec", "window",
              "draft tokens verified on a model with window layers: drafts rejected across the window's edge, hits "
              "after verification",
              frozenset({"spec", "continue", "step"}),
              ("window_drafts_rejected_across_edge", "drafts_rejected_all", "prefix_hits"),
              num_kv_blocks=48, num_state_slots=12, max_prompt_blocks=4, max_seq_blocks=7, max_active=2,
              max_new_tokens=10, spec=True,
              model="window-hybrid"),
)

MIXED = mixed()
# Every check in a fixed order: a check's index here seeds it (conformance.suite.seeds),
# and every profile lists a prefix of it, so that index is its position in the whole profile.
CATALOGUE: tuple[CheckSpec, ...] = CHECKS + (MIXED,)


@dataclass(frozen=True)
class Profile:
    name: str
    examples: int  # Hypothesis examples per check
    hypothesis_steps: int  # Hypothesis steps (rule calls) per example; a rule applies one or more operations
    checks: tuple[CheckSpec, ...]  # a prefix of CATALOGUE, so that a check's seed is its index there


PROFILES = {
    "quick": Profile("quick", examples=25, hypothesis_steps=12, checks=CHECKS),
    "standard": Profile("standard", examples=60, hypothesis_steps=20, checks=CATALOGUE),
    "nightly": Profile("nightly", examples=400, hypothesis_steps=40, checks=CATALOGUE),
}


def get_check(check_id: str) -> CheckSpec:
    """A check by id; ``id[key=value,...]`` is that check under those options
    (a variant of a configuration matrix, :mod:`conformance.suite.config_matrix`)."""
    from conformance.suite.config_matrix import parse_variant_id, variant

    base, options = parse_variant_id(check_id)
    if options:
        return variant(get_check(base), options)
    for spec in CATALOGUE:
        if spec.id == check_id:
            return spec
    raise KeyError(f"unknown check {check_id!r}; known: {', '.join(s.id for s in CATALOGUE)}")


def pool_warnings(run) -> list[str]:
    """Before the first check: each planned check whose pool (the run's
    ``--kv-blocks`` / ``--state-slots`` over the check's own) leaves one of its
    histories out of the generator's budget, and what that costs (skipped, or
    counters not asked for: :func:`conformance.generate.budget.pool_limits`).
    The check's result says it again."""
    from conformance.generate.budget import warnings

    pools = run.pools
    specs = [p.spec for p in run.checks if isinstance(p.spec, CheckSpec) and not p.spec.disagg]
    configs = [s.impl_config(block_size=pools.block_size, num_kv_blocks=pools.num_kv_blocks,
                             num_state_slots=pools.num_state_slots) for s in specs]

    def drafts(spec: CheckSpec) -> int:  # the implementation declares it when built; its spec option says it here
        value = run.spec_option[1] if spec.spec and run.spec_option else 0
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    return warnings(specs, configs, drafts)
