"""What one run or one replay may ask of this machine, checked before any
work: a model the harness can build, a memory it can allocate, prompts the
generator can draw.  Past these bounds a run does not fail cleanly: it
allocates until the machine kills it, times out building the implementation,
or crashes inside Hypothesis, and each of those would read as the
implementation's failure (exit 1) instead of the user's input (exit 2).
The bounds sit far above anything the suite asks for (its model has about
27k parameters, a check's memory about half a megabyte)."""

from __future__ import annotations

import math

from conformance.model import ModelConfig

# The model's weights, float64: 50M parameters are 400 MB (the suite's model has 49k).
MAX_PARAMETERS = 50_000_000
# The harness's memory of one session (KV blocks and state slots, float64), and the pool sizes
# behind it (each block and slot also has bookkeeping in Python lists, on both sides of the contract).
MAX_MEMORY_BYTES = 2 << 30
MAX_POOL_ENTRIES = 1 << 20
# Each model dimension (a vocabulary of a million tokens, a hidden size of 64k: no tiny model).
MAX_DIMENSION = 1 << 20


def parameters(c: ModelConfig) -> int:
    """How many weights :class:`conformance.model.TinyHybrid` draws for ``c`` (its embedding, each
    layer's projections, the head tied or not: an upper bound is what matters here)."""
    d, hd, ch = c.hidden, c.attn_heads * c.head_dim, c.conv_channels
    attention = d + 4 * d * hd
    recurrent = d + d * ch + c.conv_width * ch + 2 * d * c.rec_heads + c.rec_heads + c.rec_heads * c.rec_value_dim * d
    return 2 * c.vocab_size * d + c.num_attn_layers * attention + c.num_rec_layers * recurrent + d


# The model settings bounded here (a setting added later, such as a window, is the model's to check).
SIZES = ("vocab_size", "hidden", "repeats", "attn_heads", "head_dim", "rec_heads", "rec_key_dim", "rec_value_dim",
         "conv_width")
SCALES = ("rope_base", "init_scale", "lm_head_scale")


def model_problem(c: ModelConfig) -> str | None:
    """Why the harness cannot build this model here (None when it can):
    every size at least 1 and at most :data:`MAX_DIMENSION`, the seed at
    least 0, every scale a finite number above 0, and no more than
    :data:`MAX_PARAMETERS` weights."""
    for name in SIZES:
        value = getattr(c, name, 1)
        if not 1 <= value <= MAX_DIMENSION:
            return f"{name}: {value} must be between 1 and {MAX_DIMENSION:,}"
    if c.seed < 0:
        return f"seed: {c.seed} must be at least 0"
    for name in SCALES:
        value = getattr(c, name, 1.0)
        if not (math.isfinite(value) and value > 0):
            return f"{name}: {value} must be a finite number above 0"
    n = parameters(c)
    if n > MAX_PARAMETERS:
        return f"{n:,} parameters, more than the {MAX_PARAMETERS:,} the harness builds (a tiny model)"
    return None


def memory_bytes(c: ModelConfig, block_size: int, num_kv_blocks: int, num_state_slots: int) -> int:
    """The bytes of the harness's memory (``harness/memory.py``) for these pools, float64."""
    kv = c.num_attn_layers * num_kv_blocks * block_size * 2 * c.attn_heads * c.head_dim
    states = c.num_rec_layers * num_state_slots * ((c.conv_width - 1) * c.conv_channels
                                                   + c.rec_heads * c.rec_value_dim * c.rec_key_dim)
    return 8 * (kv + states)


def memory_problem(c: ModelConfig, block_size: int, num_kv_blocks: int, num_state_slots: int) -> str | None:
    """Why the harness cannot allocate these pools here (None when it can)."""
    for name, value in (("block_size", block_size), ("num_kv_blocks", num_kv_blocks),
                        ("num_state_slots", num_state_slots)):
        if value > MAX_POOL_ENTRIES:
            return f"{name} {value} is more than {MAX_POOL_ENTRIES:,}"
    n = memory_bytes(c, block_size, num_kv_blocks, num_state_slots)
    if n > MAX_MEMORY_BYTES:
        return (f"the harness's memory would be {n / (1 << 30):,.1f} GiB (KV blocks and state slots), more than "
                f"{MAX_MEMORY_BYTES >> 30} GiB")
    return None


def prompt_problem(vocab: int, block_size: int, max_prompt_blocks: int) -> str | None:
    """Why the generator cannot draw a check's prompts at this block size
    (None when it can): Hypothesis refuses to draw a list longer than it
    supports, and the shared prefixes are lists of block_size-token blocks."""
    from hypothesis.errors import InvalidArgument

    from conformance.generate.strategies import shared_prefixes

    try:
        shared_prefixes(vocab, block_size, max_prompt_blocks).validate()
    except InvalidArgument:
        return (f"block size {block_size}: the generator cannot draw prompts of up to {max_prompt_blocks} blocks of "
                f"{block_size} tokens (Hypothesis draws lists of at most 8192 values)")
    return None
