"""Seeded request workloads, one per check family.

A workload is a generator: it yields a *round* (a list of :class:`Req`
submitted in one ``generate`` call, so the engine may batch them) and receives
the outputs of that round, from which later rounds may be built (multi-turn).
Lengths sit at block boundaries (k*B-1, k*B, k*B+1, k*B+B/2), the same offsets
as :func:`conformance.generate.strategies.boundary_lengths`, because that is where cache
bugs live.  Why seeded generators and not Hypothesis: one engine call costs
~0.1-1 s and an engine start ~45 s, so shrinking is out of reach; a failure's
repro is the exact list of rounds instead.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass

FIRST_TOKEN = 3  # keep clear of pad/bos/eos (0, 1, 2)


@dataclass(frozen=True)
class Req:
    label: str
    prompt: tuple[int, ...]
    max_tokens: int
    expect_hit: bool = False  # by design a cache should serve part of this prompt
    shared: int = 0  # tokens shared by design with an earlier request (0: none)

    def to_dict(self) -> dict:
        return {"label": self.label, "prompt": list(self.prompt), "max_tokens": self.max_tokens}


@dataclass
class Size:
    """How much each workload does; profiles pick one."""

    max_blocks: int = 3  # shared prefixes up to max_blocks * B (+1)
    ks: tuple[int, ...] = (1, 2)  # block multiples for boundary lengths
    conversations: int = 2
    turns: int = 3
    repeats: int = 3
    groups: int = 3  # concurrent: prefix groups in one call
    group_size: int = 3
    flood_factor: float = 1.5  # eviction: distinct tokens submitted / pool tokens
    max_tokens: int = 8
    long_max_tokens: int = 32


Workload = Generator[list[Req], list, None]


def boundary_offsets(B: int) -> list[int]:
    return sorted({-1, 0, 1, B // 2})


def _toks(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN, vocab) for _ in range(n))


def mid_block(rng: random.Random, B: int, vocab: int, size: Size) -> Workload:
    """Per boundary length L: three prompts share the first L tokens, each in its
    own round.  The first warms the cache; the second may meet a junction (the
    recurrent state is only kept at the warm prompt's last block boundary); the
    third must hit (the second left a state at floor(L/B)*B)."""
    combos = [(k, off) for k in size.ks for off in boundary_offsets(B) if k * B + off >= 1]
    bases = {c: _toks(rng, vocab, c[0] * B + c[1]) for c in combos}
    for r in range(3):
        yield [Req(f"L={k * B + off} r{r}", bases[(k, off)] + _toks(rng, vocab, rng.randint(1, B)),
                   size.max_tokens, expect_hit=(r == 2 and k * B + off >= B), shared=k * B + off if r else 0)
               for (k, off) in combos]


def multi_turn(rng: random.Random, B: int, vocab: int, size: Size) -> Workload:
    """Conversations: turn t+1's prompt is turn t's prompt + its generated tokens
    + new user tokens, so each turn extends a sequence the engine just finished
    (state reuse across a prefill/decode boundary)."""
    offs = boundary_offsets(B)
    convs = [_toks(rng, vocab, B + rng.choice(offs)) for _ in range(size.conversations)]
    for t in range(size.turns):
        rnd = [Req(f"conv{i} turn{t}", c, size.max_tokens, expect_hit=t > 0 and len(c) > B, shared=len(c) if t else 0)
               for i, c in enumerate(convs)]
        outs = yield rnd
        # The user's next message ends at a block boundary offset half the time.
        convs = [r.prompt + tuple(o.tokens) + _toks(rng, vocab, max(1, rng.choice(offs) if rng.random() < 0.5
                                                                     else rng.randint(1, B)))
                 for r, o in zip(rnd, outs)]


def repeats(rng: random.Random, B: int, vocab: int, size: Size) -> Workload:
    """The same prompts again and again (and twice within one call): exact
    replays must hit and must give the first run's answer."""
    prompts = [_toks(rng, vocab, k * B + off) for k, off in ((1, 1), (2, 0), (2, B // 2))]
    for r in range(size.repeats):
        rnd = [Req(f"p{i} rep{r}", p, size.max_tokens, expect_hit=r > 0, shared=len(p) if r else 0)
               for i, p in enumerate(prompts)]
        if r == size.repeats - 1:
            rnd += [Req(f"p{i} rep{r} twin", p, size.max_tokens, expect_hit=True, shared=len(p))
                    for i, p in enumerate(prompts)]
        yield rnd


def concurrent(rng: random.Random, B: int, vocab: int, size: Size) -> Workload:
    """Groups of prompts sharing prefixes, all in one call (more than the engine
    runs at once, so some queue and find the others' blocks), shuffled; then the
    same prompts again in reverse order."""
    reqs = []
    for g in range(size.groups):
        L = rng.choice(size.ks) * B + rng.choice(boundary_offsets(B))
        base = _toks(rng, vocab, L)
        for j in range(size.group_size):
            reqs.append(Req(f"g{g} m{j}", base + _toks(rng, vocab, rng.randint(1, B)), size.max_tokens,
                            shared=L if j else 0))
    rng.shuffle(reqs)
    yield reqs
    yield [Req(r.label + " again", r.prompt, r.max_tokens, expect_hit=len(r.prompt) > B, shared=len(r.prompt))
           for r in reversed(reqs)]


def eviction(rng: random.Random, B: int, vocab: int, size: Size, pool_tokens: int = 0,
             max_prompt: int = 0) -> Workload:
    """On an engine with few blocks: warm a few prompts, flood the cache with
    distinct ones (more tokens than the pool holds, in full batches with long
    generations so requests are also preempted), then replay the warm prompts
    (evicted: must miss or hit only what survived, and still be right) and the
    last flood prompts (likely still cached)."""
    max_prompt = max_prompt or size.max_blocks * B
    warm = [_toks(rng, vocab, min(max_prompt, k * B + off)) for k, off in ((1, B // 2), (2, 1))]
    yield [Req(f"warm{i}", p, size.max_tokens) for i, p in enumerate(warm)]
    yield [Req(f"warm{i} replay", p, size.max_tokens, expect_hit=True, shared=len(p)) for i, p in enumerate(warm)]
    flood_tokens = int(size.flood_factor * max(pool_tokens, 4 * B))
    flood: list[tuple[int, ...]] = []
    while sum(map(len, flood)) < flood_tokens:
        flood.append(_toks(rng, vocab, rng.randint(B, max_prompt)))
    per_round = 8
    for i in range(0, len(flood), per_round):
        yield [Req(f"flood{i + j}", p, size.long_max_tokens) for j, p in enumerate(flood[i:i + per_round])]
    yield [Req(f"warm{i} after flood", p, size.max_tokens, shared=len(p)) for i, p in enumerate(warm)] + \
          [Req(f"flood{len(flood) - 1} replay", flood[-1], size.max_tokens, shared=len(flood[-1]))]


def speculative(rng: random.Random, B: int, vocab: int, size: Size) -> Workload:
    """For the spec family (an engine with speculative decoding, judged against
    the no-speculation run of the same prompts): prompts that repeat a short
    pattern (so that ngram finds drafts in them) and two that do not, each
    generating long enough for drafts to be proposed and verified; then the very
    same round again (an engine that depends on what earlier requests left in
    its state memory answers it otherwise).  Six distinct prompts, so that the
    tolerance's calibration sees two batch compositions (batches of 3 against
    one of 6; with 3 prompts both would be one batch and the noise read 0)."""
    patterns = [_toks(rng, vocab, n) for n in (3, 4, 5, 7)]
    prompts = [(p * (4 * B // len(p) + 4))[: 3 * len(p) + 2] for p in patterns]
    prompts += [_toks(rng, vocab, n) for n in (17, 24)]
    for r in range(2):
        yield [Req(f"p{i} round{r}", p, size.long_max_tokens) for i, p in enumerate(prompts)]


FAMILIES = {"mid-block": mid_block, "multi-turn": multi_turn, "repeats": repeats, "concurrent": concurrent,
            "eviction": eviction}
# Families that run on an engine of their own and are listed per variant, not in every profile's ALL:
# "pd" (conformance/engine/pd_checks.py) and "spec" (speculative decoding, :func:`speculative`).
SPEC_FAMILY = "spec"
