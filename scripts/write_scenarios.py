"""Writes fixtures/scenarios/*.json from the compact table below.

The JSON files are the source of truth (tests replay them); this script only
keeps them uniform and readable (one operation per line).  After editing a
scenario here, run it and then ``pytest tests/test_scenarios.py``.

    python scripts/write_scenarios.py            # (re)write every scenario
    python scripts/write_scenarios.py NAME ...   # only these
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"
B = 4  # block size of every scenario below (ImplConfig default)


def sub(rid, prompt, new=1, continues=None):
    d = {"op": "submit", "request_id": rid, "prompt": list(prompt), "max_new_tokens": new}
    if continues:
        d["continues"] = continues
    return d


def step(budget):
    return {"op": "step", "budget": budget}


def drain(budget=1024):
    return {"op": "drain", "budget": budget}


def abort(rid):
    return {"op": "abort", "request_id": rid}


# Shared token material: a "system prompt" and distinct user turns.
SYS = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
U1, U2, U3 = [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]

SCENARIOS: dict[str, dict] = {}


def hold():
    return {"op": "hold-transfers"}


def scenario(name, mutant, bug_class, title, upstream, description, steps, impl_config=None, impl="reference",
             expect=None, check=None, kind=None, vllm=None):
    SCENARIOS[name] = {
        "schema": "hybrid-cache-conformance/repro",
        "schema_version": 2,
        "title": title,
        "upstream": upstream,
        "bug_class": bug_class,
        "description": description,
        "impl": impl,
        "implementation": impl,
        "mutant": mutant or None,
        "faults": [],
        "seed": 0,
        "impl_config": {"block_size": B, "num_kv_blocks": 64, "num_state_slots": 24, "options": {},
                        **(impl_config or {})},
        "model": {},
        **({"failure": {"kind": kind}} if kind else {}),
        **({"check": check} if check else {}),
        **({"expect": expect} if expect else {}),
        **({"vllm": vllm} if vllm else {}),
        "steps": steps,
    }


# -- the four original mutants ---------------------------------------------------------

scenario(
    "late-snapshot-published-too-late", "late-snapshot", "SNAP",
    "late snapshot: the state published for a block boundary holds a later position",
    ["sglang#32606", "sglang#29792"],
    "A request with a shared 8-token prefix publishes a snapshot at each block boundary, but keeps extending "
    "the same slot, so the slot registered as 'state after 4 tokens' ends up holding the state after 8 (then "
    "after 11). A second request that shares only the first block resumes from that state.",
    [sub("first", SYS + U1), drain(), sub("second", SYS[:4] + U2), drain()])

scenario(
    "snapshot-copy-drops-conv", "snapshot-without-conv", "SNAP",
    "copy-before-extend copies the matrix state but not the conv state",
    ["sglang#34184"],
    "The second request hits the snapshot after the shared prefix. The copy into its running slot takes only "
    "the SSM matrix state; the conv window stays whatever that slot held before (here: fresh), so the first "
    "new token mixes the wrong last conv_width-1 inputs, as a hit decoding from another request's conv "
    "checkpoint does.",
    [sub("warm", SYS + U1), drain(), sub("hit", SYS + U2), drain()])

scenario(
    "hit-one-token-past-the-state", "hit-off-by-one", "SPEC",
    "prefix hit reported one token longer than the reused recurrent state",
    ["vllm#43559", "vllm#53912"],
    "MambaManager.find_longest_cache_hit ignoring drop_eagle_block reports a hit longer than the state it "
    "can restore. Here the KV matches 10 tokens (two full blocks and two tokens of the first request's tail "
    "block), the newest snapshot is the state after 8, and the cache reports a hit at 9 with that state: "
    "token 8 is never fed to the recurrent layers.",
    [sub("warm", SYS + U1), drain(), sub("hit", SYS + U1[:2] + [61, 62]), drain()])

scenario(
    "shared-block-freed-while-in-use", "free-while-referenced", "LIFETIME",
    "a finishing request returns shared blocks to the free list while another request still reads them",
    ["sglang#27038", "TRT-LLM#8813"],
    "After a warm-up caches the system prompt, requests a and b both hit it and hold its blocks together. "
    "a finishes first and drops the shared blocks outright (refcount forced to 0): b still reads them on "
    "its next step while they sit on the free list, where the next allocation would overwrite them.",
    [sub("warm", SYS + U1), drain(), sub("a", SYS + U2), sub("b", SYS + U3, new=4), drain()])


# -- the mutants added for the catalogue ------------------------------------------------

scenario(
    "snapshot-under-wrong-boundary", "snapshot-wrong-boundary", "SNAP",
    "a state is published under the start of the block it ends instead of its end",
    ["vllm#54076"],
    "An index-for-boundary slip ((computed - 1) // B * B): after computing 8 tokens the state is registered "
    "as 'the state after 4', after 11 as 'the state after 8'. A request sharing only the first block resumes "
    "from the state of a longer sequence (vllm#54076 published states under boundaries computed with the "
    "wrong block size).",
    [sub("first", SYS + U1), drain(), sub("second", SYS[:4] + U2), drain()])

P16 = SYS + [19, 20, 21, 22, 23, 24, 25, 26]
scenario(
    "attention-hit-without-recurrent-state", "unreconciled-groups", "TIER",
    "attention KV restored past the recurrent snapshot: computed tokens advance for every group",
    ["LMCache#2845", "LMCache#2863", "LMCache#2879", "vllm#53505"],
    "Snapshots are kept every 8 tokens (interval 8); the KV of 12 tokens is cached. The groups are not "
    "reconciled: the hit length is the attention hit (12) while the recurrent state comes from the snapshot "
    "after 8, so tokens 8..11 never reach the recurrent layers, as when a connector restores attention KV "
    "but not the recurrent state and num_computed_tokens advances anyway.",
    [sub("warm", P16), drain(), sub("hit", P16[:12] + [61, 62, 63]), drain()],
    impl_config={"options": {"interval": 8}})

scenario(
    "last-block-leaked-on-free", "leak-on-free", "LIFETIME",
    "freeing a request keeps a reference on its last block: bookkeeping diverges from what is held",
    ["sglang#12007"],
    "An off-by-one loop bound releases every block but the last. Nothing reads wrong data, but once the "
    "request finished and nothing runs, a block is still referenced: the pool shrinks with every request "
    "until admission stalls (the class of sglang#12007's 'Mamba Radix tree sanity check failed': the "
    "cache's own accounting no longer matches what is held).",
    [sub("only", SYS + U1), drain()])

scenario(
    "hit-block-evicted-while-in-use", "evict-referenced", "LIFETIME",
    "a prefix hit sets a shared block's refcount to 1 instead of incrementing it",
    ["sglang#27038", "TRT-LLM#8813"],
    "After the warm-up, requests a and b both hit the cached system-prompt blocks while both run; each hit "
    "sets the refcount to 1, so the blocks are counted once for two holders. When a finishes, its release "
    "drops them to 0 and queues them for eviction while b still decodes from them: the next allocation "
    "would hand b's prefix to another request (the cascade-evict class of sglang#27038, and output with "
    "tokens from other prompts as in TRT-LLM#8813).",
    [sub("warm", SYS + U1), drain(), sub("a", SYS + U2), sub("b", SYS + U3, new=4), drain(),
     sub("c", [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 50, 49, 48, 47]), drain()])

scenario(
    "partial-tail-shared-by-length", "hash-ignores-partial", "HASH",
    "the key of a prefix ending inside a block covers the tail's length, not its tokens",
    ["openvinotoolkit/model_server#4376", "vllm#50235"],
    "The warm-up's 10-token prompt leaves a cached tail block [21, 22] and the snapshot after 10. The next "
    "prompt shares the two full blocks but continues [23, 24, ...]; a key made of the full blocks and the "
    "tail's length matches the other tail, so it reuses KV and state of different tokens.",
    [sub("warm", SYS + [21, 22]), drain(), sub("other-tail", SYS + [23, 24, 25, 26]), drain()])

scenario(
    "chunk-end-block-cached-as-full", "cached-before-written", "SNAP",
    "after a chunk that ends inside a block, the block is published as full",
    ["vllm#34587"],
    "A 2-token budget computes positions 0 and 1 of an 11-token prompt, but the block is registered by the "
    "tokens the request knows (its prompt), i.e. as holding positions 0..3. A reader sharing that block "
    "would read never-written KV (vllm#34587: a 1866-token chunk against a 2048-token block, hashed as "
    "full).",
    [sub("writer", SYS + U1), step(2), sub("reader", SYS[:4] + U2), drain()])

scenario(
    "short-chunk-overwrites-shared-state", "short-chunk-conv-overwrite", "SNAP",
    "a prefill chunk shorter than the conv window writes through the shared prefix's state",
    ["vllm#56196"],
    "The second request hits the snapshot after 8 tokens and has 2 tokens left, fewer than conv_width - 1 "
    "= 3. The short-chunk path updates the state in place in the *shared* snapshot slot instead of its own "
    "copy, so the snapshot registered as 'after 8 tokens' now holds the state after 10, and a third request "
    "with the same prefix resumes from it.",
    [sub("warm", SYS + U1), drain(), sub("short", SYS + [1, 2]), drain(), sub("third", SYS + U2), drain()])


# -- vLLM's own scheduler and cache manager, with a mutant wrapped around one decision ------
# (need vLLM installed: pip install -e '.[vllm]'; tests skip them otherwise)

scenario(
    "vllm-hit-state-from-wrong-column", "vllm-state-wrong-position", "SNAP",
    "vLLM: a prefix hit resumes from the recurrent state one block column too early",
    ["vllm#39273", "vllm#54076"],
    "vLLM keeps the state at the first prompt's tail (8 tokens). The second request hits 8 tokens, and the "
    "runner must copy the state from Mamba column (8-1)//4 = 1 before extending; the mutant's runner takes "
    "column 0 (the off-by-one of vllm#39273's column indexing), so the state is another position's, or never "
    "written.",
    [sub("first", SYS + U1), drain(), sub("second", SYS + U2), drain()], impl="vllm")

scenario(
    "vllm-attention-hit-without-state", "vllm-groups-not-reconciled", "GROUPS",
    "vLLM: the coordinator takes the attention hit without reconciling the Mamba group",
    ["LMCache#2845", "LMCache#2863", "vllm#53505"],
    "The first request caches the KV of 12 tokens but keeps the state only at its tail boundary (8). The "
    "second extends the same prompt: the attention group hits 12, the Mamba group 8. The mutant coordinator "
    "lets the attention hit stand, so num_computed_tokens advances to 12 with no state there.",
    [sub("first", SYS + U1 + [24]), drain(), sub("second", SYS + U1 + [24] + U3), drain()], impl="vllm")

scenario(
    "vllm-local-tail-kept-under-external-hit", "vllm-local-tail-kept", "TIER",
    "vLLM: a longer external hit wins, but the local sub-block tail is not released",
    ["vllm#53505", "LMCache#2845"],
    "With sub-block matching and the store connector: the first request leaves a local state at its tail (3 "
    "tokens, inside the first block) and the store gets the KV block and state at 4. The second request's "
    "local hit is 3; the store's 4 is longer, so vLLM drops the local tail, but the mutant keeps the cached "
    "partial blocks and the load writes the state at 4 into the block the cache registers as the state at 3.",
    [sub("first", SYS[:4], 3), drain(), sub("second", SYS[:4] + U2 + U1), drain()],
    impl_config={"options": {"connector": True, "prefix_match_unit": 1}}, impl="vllm")


# -- the design note's four tier reconciliation cases (issue 14) ------------------------
# A: the long prompt (its blocks and states go to the host tier when the junk
# displaces them); B: its first 7 tokens (a local state and a partial block
# that end inside block 1); J: the junk; C: the request the tiers compete
# for.  "expect": the request, the tier that must win and the tokens it
# reuses (tests/test_reconciliation.py); "check": tier-races, whose
# expected-hit oracle judges the replay.
LONG = list(range(11, 21))  # 10 tokens: blocks [0,4), [4,8) and a tail
JUNK = list(range(40, 45))


# vLLM's connector path (tests/test_reconciliation.py::test_reconciliation_case_on_vllm): the same
# operations on vLLM's scheduler with the store connector; "vllm" holds the options, the pool, and
# vLLM's own winner and reuse where its semantics give other values (docs/vllm-adapter.md).  Every pool
# is at least the one vLLM starts with for these prompts (check_enough_kv_cache_memory: the attention
# pages of 11 tokens and MambaSpec.max_memory_usage_bytes' pages, 6 usable blocks under MambaMixer2 and
# 4 of 8 tokens under GDN): below it a hit can stall where vLLM would not have started.
VLLM_TIER = {
    "tier-local-longer": {
        "options": {"connector": "async", "prefix_match_unit": 1}, "num_kv_blocks": 8,
        "expect": {"winner": "local", "reuse": 6},
        "why": ("MambaMixer2's spec, B = 4, sub-block matching. vLLM keeps B's prompt state at its tail, the last "
            "hash boundary before its last prompt token (get_mamba_prefill_checkpoint_position, "
            "v1/kv_cache_interface.py:1169-1186: (7 - 1) // 1 * 1 = 6), not after all 7 tokens, so C's local "
            "hit is 6, inside block 1. The scheduler offers the connector the block-aligned local hit (4) and "
            "asks only for tokens beyond it (vLLM 0.33.0, vllm/v1/core/sched/scheduler.py:1129-1142); the "
            "store holds the state at 4 and no block past it, so it claims nothing, and the sub-block tail "
            "stays (:1179-1185). Local wins with 6: the reference's 7 minus the token vLLM's tail checkpoint "
            "leaves to compute. A remote hit of 4 cannot tie a local 6 here: vLLM never asks the connector "
            "about tokens inside the local hit.")},
    "tier-remote-longer": {
        "options": {"connector": "async"}, "num_kv_blocks": 7,
        "expect": {"winner": "remote", "reuse": 8},
        "why": ("MambaMixer2's spec, B = 4, vLLM's default match unit. A's prefill exports its checkpoint at 8 "
            "from inside its one chunk; the connector stores it with A's two full KV blocks. J's allocations "
            "evict A's states, so C's local hit is 0 (KV without a state is no hit for the hybrid manager). "
            "The connector is offered 0 and claims 8; both groups start at 8 after the load.")},
    "tier-tie-stays-local": {
        "options": {"connector": "async"}, "num_kv_blocks": 12,
        "expect": {"winner": "local", "reuse": 8},
        "why": ("MambaMixer2's spec, B = 4. Nothing is evicted: C's local hit is 8 (A's blocks and A's checkpoint "
            "at 8) and the store holds the same 8. The scheduler offers 8 and asks for tokens beyond it (vLLM "
            "0.33.0, vllm/v1/core/sched/scheduler.py:1129-1142); the next block boundary (12) is past C's 10 "
            "tokens, so the connector claims 0: in vLLM a tie is always local, by construction of the API.")},
    "tier-local-mid-block-vs-remote-boundary": {
        "options": {"connector": "async", "prefix_match_unit": 1, "layer": "gdn"}, "num_kv_blocks": 6,
        "expect": {"winner": "remote", "reuse": 8},
        "why": ("GDN's CPU spec (no prefill checkpoint block), so vLLM makes the block 8 tokens (the adapter's "
            "hybrid_block_size) and A's prefill stops at the block boundary 8, whose state the connector "
            "stores; MambaMixer2's spec exports A's checkpoint at 9 from inside one chunk instead, and no "
            "store can then hold a state at 8. C's local hit is 6 (B's tail), inside block 0; J displaced A's "
            "state at 8. The scheduler offers the block-aligned 0 (vLLM 0.33.0, "
            "vllm/v1/core/sched/scheduler.py:1129-1142), the store claims 8 (KV [0, 8) and the state at 8), "
            "and since 8 > the partial tail 6 the local tail is truncated (truncate_computed_blocks, "
            ":1167-1178): remote wins with 8, loaded asynchronously (WAITING_FOR_REMOTE_KVS, :1514-1523).")},
}


def tier_config(kv, slots):
    return {"num_kv_blocks": kv, "num_state_slots": slots, "options": {"host_tier": True}}


scenario(
    "tier-local-longer", "tier-block-granular", "TIER",
    "tiers compared in tokens: the local hit (7 tokens, inside a block) is longer than the remote (4)",
    ["design note: multi-tier partial-hit reconciliation"],
    "C's local hit ends inside block 1 (7 tokens: B's partial block and its prompt-end state); the host tier "
    "holds only the state at 4. The local tier wins with all 7 tokens. Compared in whole blocks (the mutant), "
    "the local hit rounds down to 4, the remote's 4 ties it and wins, and C reuses 4 tokens: a hit-rate "
    "failure (the logits stay right).",
    [sub("a", LONG), drain(), sub("b", LONG[:7]), drain(), sub("j", JUNK), drain(),
     sub("c", LONG[:7] + [50, 51, 52]), drain()],
    impl_config=tier_config(8, 5), check="tier-races", expect={"request": "c", "winner": "local", "reuse": 7},
    kind="hit-rate", vllm=VLLM_TIER["tier-local-longer"])

scenario(
    "tier-remote-longer", "tier-groups-unreconciled", "GROUPS",
    "tiers compared in tokens: the remote prefix (8) is longer than the local hit (0); every group follows it",
    ["design note: multi-tier partial-hit reconciliation", "vllm#46384"],
    "The junk displaces A's states (at 4 and 8) and its second block to the host tier; C's local hit is "
    "nothing (the first block's KV is still on the device, but no state goes with it). The remote tier wins "
    "with 8 and both groups are reconciled to 8. The mutant moves the attention group to 8 but keeps the "
    "recurrent group where the local hit was (a fresh state): wrong logits.",
    [sub("a", LONG), drain(), sub("j", JUNK), drain(), sub("c", LONG[:8] + [50, 51]), drain()],
    impl_config=tier_config(8, 3), check="tier-races", expect={"request": "c", "winner": "remote", "reuse": 8},
    kind="logits", vllm=VLLM_TIER["tier-remote-longer"])

scenario(
    "tier-tie-stays-local", "", "TIER",
    "tiers compared in tokens: a tie (8 and 8) stays local, with no transfer",
    ["design note: multi-tier partial-hit reconciliation"],
    "C's local hit and the host tier's prefix are both 8 tokens: the same reuse either way, so the local tier "
    "wins and nothing is loaded.",
    [sub("a", LONG), drain(), sub("b", LONG[:7]), drain(), sub("j", JUNK), drain(),
     sub("c", LONG[:8] + [50, 51]), drain()],
    impl_config=tier_config(6, 6), check="tier-races", expect={"request": "c", "winner": "local", "reuse": 8},
    vllm=VLLM_TIER["tier-tie-stays-local"])

scenario(
    "tier-local-mid-block-vs-remote-boundary", "tier-tail-not-released", "TIER",
    "tiers compared in tokens: a local hit ending inside a block (7) against a remote block boundary (8)",
    ["design note: multi-tier partial-hit reconciliation", "vllm#49502"],
    "C's local hit ends inside block 1 (7 tokens) and holds a block for its partial tail while the tiers are "
    "compared; the host tier holds A's block [4, 8) and the state at 8. The remote tier wins with 8 tokens, "
    "and the block held for the local tail must go back: the mutant leaks it.",
    [sub("a", LONG), drain(), sub("b", LONG[:7]), drain(), sub("j", JUNK), drain(),
     sub("c", LONG[:8] + [50, 51]), drain()],
    impl_config=tier_config(8, 5), check="tier-races", expect={"request": "c", "winner": "remote", "reuse": 8},
    kind="invariant", vllm=VLLM_TIER["tier-local-mid-block-vs-remote-boundary"])


def main(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, doc in SCENARIOS.items():
        if names and name not in names:
            continue
        head = {k: v for k, v in doc.items() if k != "steps"}
        text = json.dumps(head, indent=2)[:-2] + ',\n  "steps": [\n'
        text += ",\n".join("    " + json.dumps(s) for s in doc["steps"]) + "\n  ]\n}\n"
        json.loads(text)  # the hand-made layout must still be JSON
        (OUT / f"{name}.json").write_text(text)
        print(f"wrote {OUT / (name + '.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
