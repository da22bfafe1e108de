"""Argument strategies more than one rule group draws with (each a function
of the configuration, see :func:`~conformance.generate.configured.configured_rule`)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import Conf


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
