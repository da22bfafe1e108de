"""Speculative decoding on vLLM's real scheduler (issue 22), configured as
vLLM 0.33.0 configures it; the harness is the drafter and the verifier.

What vLLM's own configuration code gives the scheduler (read from the
installed 0.33.0; line numbers approximate):

- ``SpeculativeConfig`` (``vllm/config/speculative.py``) is built as vLLM's
  arguments build it: ``method="eagle"`` with an EAGLE head (the adapter's
  tiny Llama config, so the draft is ``EagleLlamaForCausalLM``),
  ``method="mtp"`` on a Qwen3-Next target with one MTP module (the draft's
  model type becomes ``qwen3_next_mtp``; the target is a tiny
  ``config.json`` only, as the adapter's own model), or ``method="ngram"``
  (``prompt_lookup_max=3, prompt_lookup_min=1``, as the engine host builds
  it).  The scheduler then reads ``num_speculative_tokens``,
  ``use_eagle()`` and ``use_eagle_block_drop()`` (scheduler.py ~294-345).
- ``VllmConfig.num_lookahead_tokens`` (config/vllm.py ~626): k for EAGLE and
  MTP, 0 for ngram; ``num_prefill_lookahead_tokens`` (~655): 1 for EAGLE and
  single-module MTP; ``num_hash_lookahead_tokens`` (~678): that lookahead when
  the block drop applies, prefix caching is on and there is no KV connector,
  and then the scheduler turns the block drop off ("lookahead hashes prove
  the boundary token"); ``spec_lookahead_hashes=false`` sets
  ``disable_lookahead_block_hashes`` and so takes the block-drop path
  (``FullAttentionManager`` takes one hash unit or block off a hit,
  single_type_kv_cache_manager.py ~826-831; ``MambaManager`` ignores the flag
  and the coordinator's fixed point reconciles, kv_cache_coordinator.py ~806).
  With EAGLE or single-module MTP the scheduler sees the same numbers.
- ``MambaBase.get_kv_cache_spec`` (layers/mamba/abstract.py ~72-91) gives the
  Mamba group ``num_speculative_blocks = num_speculative_tokens`` for every
  method, ngram included (``config.mamba_spec``).

What the harness does as the worker (``translate.RunnerState``): the state
columns of a verification row (``gdn_attn`` build with
``mamba_get_block_table_tensor``: 1 + k blocks from ``(seq_len - 1) // B``),
the accepted column the next step resumes from (``preprocess_mamba``'s
``accept_token_bias``), and the accepted boundary column copied into its block
after verification (``postprocess_mamba_fused_kernel``) as a snapshot at the
draft position, which the harness takes only when the verifier accepts
through it.  Drafts reach the scheduler as the engine hands them over after a
step (``Scheduler.update_draft_token_ids``), verified tokens as the sampler
reports them (accepted drafts, then the bonus token).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from typing import Any

import conformance.adapters.vllm.compat as compat
from conformance.contract import Speculation

METHODS = ("eagle", "mtp", "ngram")
NGRAM = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}  # as the engine host builds it (docs/engine-adapter.md)

# A tiny Qwen3-Next target with one MTP module (fixtures/models/qwen3next-tiny.json,
# config only): what the MTP draft config is derived from.
_QWEN3NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 64,
              "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
              "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
              "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 2,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
              "decoder_sparse_step": 1, "max_position_embeddings": 65536, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_mtp_layers": 1}


def validate(k, method, lookahead_hashes) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"spec_tokens must be an integer >= 0, got {k!r}")
    if method not in METHODS:
        raise ValueError(f"unknown spec_method {method!r} (expected one of {METHODS})")
    if not isinstance(lookahead_hashes, bool):
        raise ValueError(f"spec_lookahead_hashes must be true or false, got {lookahead_hashes!r}")


@functools.lru_cache(maxsize=2)
def _mtp_target(max_model_len: int):
    from vllm.config import ModelConfig

    folder = tempfile.mkdtemp(prefix="hcc-vllm-mtp-target-")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(_QWEN3NEXT, fh)
    return ModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len)


_BUILT: dict[tuple, object] = {}


def speculative_config(method: str, k: int, lookahead_hashes: bool, model_config):
    """The ``SpeculativeConfig`` vLLM builds for ``method`` with k drafts on
    ``model_config`` (the adapter's tiny one): a copy of one built once per
    process at the ceiling ``max_model_len`` (the draft model's config is
    inspected in a subprocess, and every pool is fitted another length,
    :mod:`.startup`), with the target's length set as vLLM's own
    ``_maybe_override_draft_max_model_len`` sets it: the draft's length capped
    at the target's.  The scheduler only reads it."""
    from conformance.adapters.vllm.tiny_model import MAX_MODEL_LEN_CEILING
    from conformance.adapters.vllm.tiny_model import model_config as tiny_model_config

    key = (method, k, lookahead_hashes)
    if key not in _BUILT:
        _BUILT[key] = _build(method, k, lookahead_hashes, tiny_model_config(MAX_MODEL_LEN_CEILING))
    built: Any = copy.copy(_BUILT[key])
    length = model_config.max_model_len
    if method != "mtp":
        built.target_model_config = model_config
    else:
        target = copy.copy(built.target_model_config)
        target.max_model_len = length
        built.target_model_config = target
    if method == "ngram":
        built.draft_model_config = model_config  # ngram drafts with the target (SpeculativeConfig.__post_init__)
    elif built.draft_model_config is not None and built.draft_model_config.max_model_len > length:
        built.draft_model_config = copy.copy(built.draft_model_config)
        built.draft_model_config.max_model_len = length
    return built


def _build(method: str, k: int, lookahead_hashes: bool, model_config):
    from vllm.config import ParallelConfig, SpeculativeConfig

    kw: dict[str, Any] = dict(method=method, num_speculative_tokens=k, target_parallel_config=ParallelConfig())
    if compat.has_lookahead_block_hashes():
        kw["disable_lookahead_block_hashes"] = not lookahead_hashes
    # before 0.33.0 there are no lookahead block hashes: EAGLE always takes the block drop there
    if method == "eagle":
        kw.update(model=model_config.model, target_model_config=model_config)
    elif method == "mtp":
        kw.update(target_model_config=_mtp_target(model_config.max_model_len))
    else:
        kw.update(target_model_config=model_config, **NGRAM)
    return SpeculativeConfig(**kw)


def declaration(scheduler, vllm_config) -> Speculation | None:
    """What the adapter declares of vLLM's speculative decoding: its k, a
    state column per draft, and what a hit gives back for the drafter: one
    hash unit (or block) under the block drop, or the hash lookahead (a hit
    of p tokens needs the next L tokens to match the cached sequence too:
    at most the KV hit less L)."""
    k = vllm_config.num_speculative_tokens
    if not k:
        return None
    if scheduler.use_eagle_block_drop:
        # FullAttentionManager.find_longest_cache_hit: hit_length -= min(alignment_tokens,
        # block_size), the same in 0.30.0-0.33.0; the alignment as this release resolves it
        drop = min(compat.cache_hit_alignment_tokens(scheduler), vllm_config.cache_config.block_size)
    else:
        drop = compat.hash_lookahead_tokens(vllm_config)
    return Speculation(k, "per-position", drop)


def propose(scheduler, request_id: str, tokens: tuple[int, ...]) -> None:
    """The drafter's proposal reaches vLLM as the engine hands it over after
    a step (``EngineCore.post_step`` -> ``update_draft_token_ids``)."""
    from vllm.v1.outputs import DraftTokenIds

    scheduler.update_draft_token_ids(DraftTokenIds(req_ids=[request_id], draft_token_ids=[list(tokens)]))


def sampled(plan_step, result) -> list[int]:
    """What the sampler reports for one request: the accepted drafts, then
    the token after them (rejected positions are not returned).  Where the
    accepted drafts reached the request's last token the harness samples
    nothing after them, but vLLM's sampler always returns its bonus token and
    ``check_stop`` drops what passes ``max_tokens``: a placeholder stands in
    for it, so that ``num_computed_tokens`` ends where the harness's does."""
    rid = plan_step.request_id
    accepted = result.accepted.get(rid, 0)
    if rid in result.sampled:
        return [*plan_step.drafts[:accepted], result.sampled[rid]]
    return [*plan_step.drafts[:accepted], 0] if plan_step.drafts else []
