"""Argument strategies more than one rule group draws with (each a function
of the configuration, see :func:`~conformance.generate.configured.configured_rule`)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import Conf
from conformance.harness.ops import Drain, Submit
from conformance.judge.memory_coverage import Held
from conformance.judge.reuse import INDEXES


def suffix_args(lengths):
    return dict(suffix_len=lambda c: st.sampled_from(lengths(c.B)),
                suffix=lambda c: strategies.tokens(c.vocab, c.B + 1),
                max_new=lambda c: st.integers(1, c.spec.max_new_tokens))




def junk_prompts(c: Conf) -> st.SearchStrategy:
    # Junk long enough that one round turns over most of the pool: shorter
    # prompts only take never-used blocks and never evict anything reused.
    length = max(4 * c.B, min(c.max_len, c.num_kv_blocks // 3 * c.B) - 1)
    return st.lists(strategies.tokens(c.vocab, length), min_size=2, max_size=3)




# A prompt that diverges from an earlier sequence at every offset inside a block.
DIVERGING: dict[str, Any] = dict(
    which=lambda c: st.integers(0, 7), k=lambda c: st.integers(0, c.spec.max_prompt_blocks),
    offset=lambda c: st.integers(0, c.B - 1), tail=lambda c: st.booleans(),
    rest=lambda c: strategies.tokens(c.vocab, c.B), max_new=lambda c: st.integers(1, c.spec.max_new_tokens))


def tail_against_remote(machine, seed: int, length: int, k: int, offset: int, more: int,
                        block_end: bool = False) -> tuple[tuple[int, ...], ...]:
    """The four prompts of the tiers' fourth case (a local hit ending inside
    block ``k`` against the host tier's hit at that block's end), their
    tokens from ``seed``: a prompt A of ``length`` tokens; (with
    ``block_end``, A up to block ``k``'s end: a state there where a cache
    keeps only prompt ends and block-aligned chunk ends); A cut ``offset``
    tokens into block ``k``; junk, distinct from A's start, that takes as many
    state slots as the pool has beyond A's checkpoints (one per block, the
    densest a cache keeps), so that an LRU displaces A's older entries to the
    host tier but keeps the younger, mid-block one; A up to block ``k``'s end
    and a token A does not have there.  Empty when block ``k`` is not inside A."""
    B, cut, vocab = machine.B, k * machine.B, machine.model.config.vocab_size
    if cut >= length:
        return ()
    rng = random.Random(seed)
    a = tuple(rng.randrange(vocab) for _ in range(length))
    blocks = min(machine.max_len // B, max(1, machine.impl_config.num_state_slots - -(-length // B) + more))
    junk = ((a[0] + 1 + rng.randrange(max(1, vocab - 1))) % vocab,) + tuple(  # never A's start
        rng.randrange(vocab) for _ in range(blocks * B - 2))
    other = (a[cut] + 1 + rng.randrange(max(1, vocab - 1))) % vocab  # never A's token after the boundary
    head = (a, a[:cut]) if block_end else (a,)
    return (*head, a[: cut - B + offset], junk, a[:cut] + (other,))


def boundary_state_alone(machine, a: tuple[int, ...], cut: int) -> None:
    """Run ``a[:cut]`` on its own when memory holds no state after it: a
    cache that keeps prompt ends only (retention interval 0, vLLM's default)
    keeps none at a block boundary inside a longer prompt, and the host tier
    can bring back only what the device once held.  Where the cache kept one
    (a checkpoint at every block) nothing is run: the history is as before."""
    if a[:cut] not in Held(machine.session.memory).states and machine.fits(cut, 1):
        machine.apply(Submit(machine.new_id(), a[:cut], 1))
        machine.apply(Drain(1024))


def displace_boundary_state(machine, a: tuple[int, ...], cut: int, junk: tuple[int, ...]) -> None:
    """While the device still lists the state after ``a[:cut]``, one-block
    prompts (the junk's first block and a token, shifted) follow, at most as
    many as the state pool: the junk is sized to take the state slots of a
    cache that keeps a state at every block (one long prompt), which a cache
    that keeps prompt ends only fills with one state, so the boundary's state
    stayed on the device and the host tier had nothing to beat a local hit
    with (the reference under interval 0: tier_hits_over_local 0 at seed 4).
    Younger than the mid-block local entry, they leave it to the LRU's last."""
    B, vocab = machine.B, machine.model.config.vocab_size
    for i in range(1, machine.impl_config.num_state_slots + 1):
        if a[:cut] not in INDEXES.get(machine.session.last_view, B).states:
            return
        prompt = tuple((t + i) % vocab for t in junk[: B + 1])
        if not machine.fits(len(prompt), 1):
            return
        machine.apply(Submit(machine.new_id(), prompt, 1))
        machine.apply(Drain(1024))


def asked_again(memory, track) -> tuple[int, ...]:
    """What a finished request's prompt is asked for again as: the prompt,
    or, where memory holds nothing that can serve the prompt itself, the
    prompt and its first output token (a next turn).  Under prompt-end
    retention the state at the prompt's end is all there is, and a request
    for the same prompt cannot start there (one token is left to compute)."""
    prompt = track.tokens[: track.prompt_len]
    held = Held(memory)
    return prompt if held.reuse(prompt) else track.tokens[: track.prompt_len + 1]
