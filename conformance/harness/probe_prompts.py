"""The pool probe's prompts: fixed by the probe's sizes, so the oracle
computes each reference once per run (it memoizes by prefix) and a repro
replays the very same requests.

Why a probe at all: a leaked KV block or state slot is invisible in the
implementation's own view when that view is empty or wrong, but not in what
the implementation can still serve.  At idle a correct cache serves what a
fresh instance of it serves; a cache that leaked no longer can.
"""

from __future__ import annotations

import random

from conformance.harness.memory import Prefix

# Seeds of the probe's token streams (any fixed values: the prompts only
# need to be the same in every process).
_SHORT_SEED, _LONG_SEED = 0x5107, 0x10A6
SHORT_LEN = 2  # tokens of each concurrent probe request: one KV block, one state slot


def probe_prompts(vocab: int, kv_tokens: int, concurrent: int) -> tuple[list[Prefix], Prefix]:
    """(``concurrent`` distinct short prompts, one ``kv_tokens``-token prompt)."""
    rng = random.Random(_SHORT_SEED)
    short: list[Prefix] = []
    seen: set[Prefix] = set()
    while len(short) < concurrent:
        p = tuple(rng.randrange(vocab) for _ in range(SHORT_LEN))
        if p not in seen or len(seen) >= vocab ** SHORT_LEN:
            seen.add(p)
            short.append(p)
    rng = random.Random(_LONG_SEED)
    long = tuple(rng.randrange(vocab) for _ in range(kv_tokens))
    return short, long
