"""Hypothesis strategies for prompts, shared by the cache-level machine and the
engine-level checks.

Bugs live at block boundaries, so lengths are drawn relative to the block
size (k*B - 1, k*B, k*B + 1, mid-block) rather than uniformly, and prompts are
built from a few shared prefixes so that hits happen often.
"""

from __future__ import annotations

from hypothesis import strategies as st


def boundary_lengths(block_size: int, max_blocks: int, min_len: int = 1) -> st.SearchStrategy[int]:
    """k*B - 1, k*B, k*B + 1 or k*B + B//2, for k in [1, max_blocks]."""
    offsets = sorted({-1, 0, 1, block_size // 2})
    return st.builds(lambda k, off: max(min_len, k * block_size + off),
                     st.integers(1, max_blocks), st.sampled_from(offsets))


def tokens(vocab: int, n: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n).map(tuple)


def shared_prefixes(vocab: int, block_size: int, max_blocks: int, count: int = 3) -> st.SearchStrategy:
    """A bundle of ``count`` base sequences; prompts are cut from them."""
    return st.lists(st.integers(0, vocab - 1), min_size=count * (max_blocks + 1) * block_size,
                    max_size=count * (max_blocks + 1) * block_size).map(
        lambda flat: tuple(tuple(flat[i * (max_blocks + 1) * block_size:(i + 1) * (max_blocks + 1) * block_size])
                           for i in range(count)))


def budgets(block_size: int) -> st.SearchStrategy[int]:
    """Per-step token budgets whose chunk ends split blocks."""
    B = block_size
    return st.sampled_from(sorted({1, 2, 3, B - 1, B + 1, 2 * B + 1, 4 * B, 1024} - {0}))
