"""The adapter's tiny ModelConfig: a two-layer decoder folder and the
ModelConfig vLLM inspects from it, built once per process at the ceiling
length and copied for shorter ones.  Its own module so that the scheduler's
configuration (config.py) and the speculative one (speculative.py) both
build on it without importing each other."""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile

# A tiny decoder config: ModelConfig inspects the architecture in a subprocess
# (about 15 s), so the folder and the ModelConfig are built once per process.
_TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 65536,
                "torch_dtype": "float32", "rms_norm_eps": 1e-6}


# The longest max_model_len the adapter fits a pool to (vLLM's start-up check
# decides below it); a longer one is built only when asked for.
MAX_MODEL_LEN_CEILING = 4096


@functools.lru_cache(maxsize=4)
def _built_model_config(max_model_len: int):
    from vllm.config import ModelConfig

    folder = tempfile.mkdtemp(prefix="hcc-vllm-model-")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(_TINY_CONFIG, fh)
    return ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)


def _model_config(max_model_len: int):
    """A ModelConfig of this ``max_model_len``.  Up to the ceiling, a copy of
    the one built at the ceiling with the length set, as vLLM's own
    ``estimate_max_model_len`` sets it: building another costs a model
    inspection in a subprocess (15 s), and every pool fits another length."""
    if max_model_len > MAX_MODEL_LEN_CEILING:
        return _built_model_config(max_model_len)
    base = _built_model_config(MAX_MODEL_LEN_CEILING)
    if max_model_len == base.max_model_len:
        return base
    config = copy.copy(base)
    config.max_model_len = max_model_len
    return config


def model_config(max_model_len: int | None = None):
    """The adapter's tiny ``ModelConfig`` of this length (``None``: the ceiling
    a pool is fitted under)."""
    return _model_config(max_model_len or MAX_MODEL_LEN_CEILING)
