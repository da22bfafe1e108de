"""Builds vLLM's configuration objects locally, without a hub or a GPU.

The scheduler takes its hybrid behaviour only from the ``KVCacheConfig`` (one
full-attention group, one Mamba group in "align" mode) and from
``CacheConfig``; the ``ModelConfig`` is required by ``VllmConfig`` but only its
``max_model_len`` matters, so it is built from a throw-away folder holding a
tiny ``config.json`` (no weights, no tokenizer).

The specs are built the way the installed release's own layers build theirs;
what differs between the supported releases (0.30.0-0.33.0) is asked of
:mod:`.compat`, which names each difference with file:line per release.  Line
numbers below are vllm 0.33.0's:

- ``MambaBase.get_kv_cache_spec`` (model_executor/layers/mamba/abstract.py:72-91)
  makes a ``MambaSpec`` with the state shapes of the layer, block size
  ``cache_config.mamba_block_size``, ``page_size_padded`` and the cache mode.
- ``MambaMixer2.get_kv_cache_spec`` (layers/mamba/mamba_mixer2.py:1108-1118,
  added in 0.32.0) always adds ``num_prefill_checkpoint_blocks=1,
  prefill_checkpoint_alignment=1``: the scheduler then stops splitting a
  prefill at the prompt's checkpoint and the worker exports that state from
  inside the step (``layer="mamba2"``, the default here).  0.30.0 and 0.31.0
  keep the base spec (:func:`.compat.prefill_checkpoint_fields`).
- ``QwenGatedDeltaNetAttention.get_kv_cache_spec``
  (layers/mamba/gdn/qwen_gdn_linear_attn.py:739-760, 0.33.0 only) adds them only
  with the FlashInfer prefill backend (CUDA SM90/SM100, lines 688-696); on a
  CPU or with the Triton backend it keeps the base spec, with no checkpoint
  block (``layer="gdn"``), as every earlier release does.
- Block sizes: ``Platform._align_hybrid_block_size`` (platforms/interface.py:
  1068-1128, called for the CPU platform from platforms/cpu.py:570; the same
  formula for this model in 0.30.0-0.32.0, see :mod:`.compat`) raises the
  attention block size to the smallest kernel-aligned size whose page holds a
  Mamba page, sets ``mamba_block_size = block_size`` in align mode and pads the
  Mamba page to the attention page.  :func:`hybrid_block_size` applies that
  formula to this adapter's tiny model (the harness's default model:
  fixtures/models/tiny-hybrid.toml), with the harness's block size as the
  user's ``--block-size`` and a kernel alignment of 1 (the tiny model has no
  kernel), so an asked-for block size is raised when, and as far as, vLLM
  would raise it.
- ``max_model_len``: fitted to the pool by vLLM's own start-up check
  (:mod:`.startup`), unless asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import conformance.adapters.vllm.compat as compat
from conformance.adapters.vllm.tiny_model import MAX_MODEL_LEN_CEILING, model_config
from conformance.contract import ImplConfig

ADMISSIONS = ("second-hit", "always")
LAYERS = ("mamba2", "gdn")
# String forms of the ``connector`` option (short enough for a check id:
# ``tier-reuse[connector=divergent]``).
CONNECTOR_FORMS = {"async": {}, "divergent": {"divergent": True}, "sync": {"async": False},
                   "divergent-sync": {"divergent": True, "async": False}}
# vLLM's own offloading connector in the same slot, by its manager's policy
# (vllm/v1/kv_offload/cpu/policies/factory.py): one option, one tier, so a
# user's --option connector=offload-arc replaces every tier variant's choice.
OFFLOAD_FORMS = {"offload-lru": "lru", "offload-arc": "arc"}

# The tiny model the specs describe: the harness's default model
# (fixtures/models/tiny-hybrid.toml), one attention layer's KV and one
# recurrent layer's state.  The scheduler never allocates tensors; these sizes
# matter only through the page sizes that choose the block size.
TINY = {"attn_kv_heads": 2, "head_dim": 16, "rec_heads": 2, "rec_key_dim": 8, "rec_value_dim": 8,
        "conv_width": 4}


@dataclass(frozen=True)
class VllmOptions:
    """``ImplConfig.options`` understood by the vLLM adapter (unknown keys are an error).

    - ``prefix_match_unit``: vLLM's ``hash_block_size``; must divide the block size.
      Smaller than the block size turns on sub-block (partial) hits.
    - ``retention_interval``: ``CacheConfig.prefix_cache_retention_interval``:
      ``0`` (engine default: replay boundaries and junctions only), ``None``
      (dense: every block boundary), ``N`` (a multiple of the block size).
    - ``admission``: ``"second-hit"`` (vLLM's Marconi-style shared-prefix
      junctions, always on in 0.33) or ``"always"`` (accepted as an alias of
      vLLM's behaviour: vLLM has no switch to turn the junction logic off, so
      the adapter does not pretend to; see docs/vllm-adapter.md).
    - ``max_num_seqs``: a scheduler limit.
    - ``max_model_len``: ``None`` (the default): the largest length vLLM's
      start-up check accepts for the pool, at most :data:`MAX_MODEL_LEN_CEILING`,
      as ``--max-model-len -1`` fits it (:mod:`.startup`); a number: that
      length, refused when vLLM's start-up check refuses it.
    - ``shared_prefix_checkpoint``: ``enable_mamba_shared_prefix_checkpoint``.
    - ``connector``: ``None``, ``true`` or ``{"divergent": bool, "async": bool}`` to plug in
      the store connector over the harness's host tier (see :mod:`.connector`); the
      strings ``"async"``, ``"divergent"``, ``"sync"``, ``"divergent-sync"`` name the same.
      ``"offload-lru"`` / ``"offload-arc"``: vLLM's own ``OffloadingConnector`` instead,
      with its ``CPUOffloadingManager`` under that policy, the harness as its worker
      (:mod:`.offloading`; ``offload`` then names the policy).
    - ``layer``: whose ``get_kv_cache_spec`` the Mamba group follows: ``"mamba2"``
      (``MambaMixer2``: one prefill checkpoint block, alignment 1) or ``"gdn"``
      (Gated DeltaNet as it runs on a CPU or with Triton: none).
    - ``spec_tokens``: speculative decoding with k drafts per step (0: off;
      :mod:`.speculative`), by ``spec_method`` (``"eagle"``, ``"mtp"``,
      ``"ngram"``); ``spec_lookahead_hashes`` false sets
      ``disable_lookahead_block_hashes`` (the block-drop path).

    ``block_size`` is the block size vLLM ends up with for the asked one
    (:func:`hybrid_block_size`), the same for both groups in align mode.
    """

    block_size: int
    num_blocks: int
    prefix_match_unit: int
    retention_interval: int | None = 0
    admission: str = "second-hit"
    max_num_seqs: int = 16
    max_model_len: int | None = None
    shared_prefix_checkpoint: bool = False
    connector: dict | None = None
    layer: str = "mamba2"
    spec_tokens: int = 0
    spec_method: str = "eagle"
    spec_lookahead_hashes: bool = True
    offload: str | None = None  # the policy, with connector="offload-lru" / "offload-arc" (.offloading)

    @classmethod
    def from_config(cls, config: ImplConfig) -> VllmOptions:
        o = dict(config.options)
        known = {"prefix_match_unit", "retention_interval", "interval", "admission", "max_num_seqs",
                 "max_model_len", "shared_prefix_checkpoint", "connector", "layer", "spec_tokens", "spec_method",
                 "spec_lookahead_hashes"}
        unknown = set(o) - known
        if unknown:
            raise ValueError(f"unknown vLLM adapter options: {sorted(unknown)} (known: {sorted(known)})")
        layer = o.get("layer", "mamba2")
        if layer not in LAYERS:
            raise ValueError(f"unknown layer {layer!r} (expected one of {LAYERS})")
        bs = hybrid_block_size(config.block_size, layer)
        pmu = o.get("prefix_match_unit") or bs
        if bs % pmu:
            raise ValueError(f"prefix_match_unit {pmu} must divide the block size {bs}")
        # "interval" is the reference adapter's name for the same knob.
        interval = o.get("retention_interval", o.get("interval", 0))
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
            raise ValueError(f"retention interval must be None or an integer >= 0, got {interval!r}")
        if interval is not None and interval % bs:
            raise ValueError(f"retention interval {interval} is not a multiple of the block size {bs}")
        admission = o.get("admission", "second-hit")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission policy {admission!r} (vLLM supports {ADMISSIONS})")
        # Block 0 is vLLM's null block; the pool needs at least one usable block.
        if config.num_kv_blocks < 2:
            raise ValueError("the vLLM block pool needs at least 2 blocks (block 0 is the null block)")
        from conformance.adapters.vllm.speculative import validate as validate_spec

        spec = (o.get("spec_tokens", 0), o.get("spec_method", "eagle"), o.get("spec_lookahead_hashes", True))
        validate_spec(*spec)
        if spec[0] and spec[0] > bs:
            raise ValueError(f"spec_tokens {spec[0]} above the block size {bs}: vLLM's coordinator refuses a block "
                             f"size below the prefill lookahead, and a verification would span more than one "
                             f"block boundary")
        connector = connector_option(o.get("connector"))
        named = o.get("connector")
        offload = OFFLOAD_FORMS.get(named) if isinstance(named, str) else None
        return cls(block_size=bs, num_blocks=config.num_kv_blocks, prefix_match_unit=pmu, offload=offload,
                   spec_tokens=spec[0], spec_method=spec[1], spec_lookahead_hashes=spec[2],
                   retention_interval=interval, admission=admission,
                   max_num_seqs=int(o.get("max_num_seqs", 16)), max_model_len=_length(o.get("max_model_len")),
                   shared_prefix_checkpoint=bool(o.get("shared_prefix_checkpoint", False)),
                   connector=connector, layer=layer)


def _length(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_model_len must be a positive integer (or absent: fitted to the pool), got {value!r}")
    return value


def connector_option(value) -> dict | None:
    """``None``/``False``: no connector; ``True``: the default one; a dict or
    one of :data:`CONNECTOR_FORMS`: its settings."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        if value in OFFLOAD_FORMS:
            return None  # not the store connector: VllmOptions.offload
        if value not in CONNECTOR_FORMS:
            raise ValueError(f"unknown connector {value!r} (expected true, a table, or one of "
                             f"{sorted(CONNECTOR_FORMS) + sorted(OFFLOAD_FORMS)})")
        return dict(CONNECTOR_FORMS[value])
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"connector: expected true, a table or a name, got {value!r}")


def _shape_calculator():
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator


def mamba_state_shapes(layer: str) -> tuple[tuple[int, ...], ...]:
    """The state shapes the layer's ``get_state_shape`` gives the tiny model,
    by vLLM's own calculator (layers/mamba/mamba_utils.py)."""
    t, calc = TINY, _shape_calculator()
    if layer == "gdn":
        # QwenGatedDeltaNetAttention.get_state_shape (qwen_gdn_linear_attn.py:545-556)
        return tuple(calc.gated_delta_net_state_shape(1, t["rec_heads"], t["rec_heads"], t["rec_key_dim"],
                                                      t["rec_value_dim"], t["conv_width"]))
    # MambaMixer2.get_state_shape: heads x head_dim values, a state of size
    # d_state, one group (the harness's heads read keys of rec_key_dim).
    return tuple(calc.mamba2_state_shape(1, t["rec_heads"] * t["rec_value_dim"], 1, t["rec_heads"],
                                         t["rec_value_dim"], t["rec_key_dim"], t["conv_width"]))


_DTYPE_BYTES = 4  # float32 for both groups: only the ratio of the two pages matters


def attention_page_per_token() -> int:
    """``FullAttentionSpec(block_size=1, ...).page_size_bytes``: K and V."""
    return 2 * TINY["attn_kv_heads"] * TINY["head_dim"] * _DTYPE_BYTES


def mamba_page(layer: str) -> int:
    """``MambaSpec.page_size_bytes`` before padding (kv_cache_interface.py:1118-1126)."""
    total = 0
    for shape in mamba_state_shapes(layer):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total * _DTYPE_BYTES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hybrid_block_size(requested: int, layer: str = "mamba2", kernel_block: int = 1) -> int:
    """The attention (and, in align mode, Mamba) block size vLLM chooses for
    the tiny model when asked for ``requested`` (platforms/interface.py):

    - kernel_block_alignment_size = max(smallest kernel block, block_size) (:1053-1060);
    - in align mode, lcm with the layers' prefill checkpoint alignment (:1073-1078):
      ``get_mamba_prefill_checkpoint_alignment`` is None for MambaMixer2 (it does
      not override ``get_prefill_checkpoint_alignment``) and for GDN off
      FlashInfer, so ``or 1``;
    - attn_block_size = alignment * cdiv(mamba_page, alignment * attn_page_1_token) (:1082-1085);
    - block_size = max(block_size, attn_block_size) (:1090-1096); mamba_block_size = block_size (:1098-1099).
    """
    align = max(kernel_block, requested)
    attn_block = align * _cdiv(mamba_page(layer), align * attention_page_per_token())
    return max(requested, attn_block)




def build_vllm_config(opts: VllmOptions, kv_transfer_config=None):
    """A VllmConfig with prefix caching on and Mamba "align" mode."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    # The budget is set per step by the adapter; this is only the ceiling.
    length = opts.max_model_len or MAX_MODEL_LEN_CEILING
    # max_num_batched_tokens: a ceiling only (the budget is set per step), at
    # most what max_num_seqs requests of max_model_len could use (vLLM warns
    # above that); it never binds before the harness's budget does.
    batched = min(MAX_MODEL_LEN_CEILING, opts.max_num_seqs * length)
    sched = SchedulerConfig(max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=batched,
                            max_model_len=length, enable_chunked_prefill=True,
                            is_encoder_decoder=False, watermark=0.0)
    # mamba_block_size = block_size in align mode (interface.py:1098-1099 and
    # models/config.py:778-779).
    # mamba_cache_mode "align": what every supported release sets with prefix caching on (.compat).
    fields: dict[str, Any] = {compat.shared_prefix_checkpoint_field(): opts.shared_prefix_checkpoint}
    cache = CacheConfig(block_size=opts.block_size, enable_prefix_caching=True, mamba_cache_mode="align",
                        mamba_block_size=opts.block_size, prefix_match_unit=opts.prefix_match_unit,
                        prefix_cache_retention_interval=opts.retention_interval, **fields)
    kw = {} if kv_transfer_config is None else {"kv_transfer_config": kv_transfer_config}
    if opts.spec_tokens:
        from conformance.adapters.vllm.speculative import speculative_config

        kw["speculative_config"] = speculative_config(opts.spec_method, opts.spec_tokens, opts.spec_lookahead_hashes,
                                                      model_config(length))
    vc = VllmConfig(model_config=model_config(length), scheduler_config=sched, cache_config=cache,
                    **kw)
    vc.cache_config.num_gpu_blocks = opts.num_blocks
    return vc


ATTN_GROUP, MAMBA_GROUP = 0, 1


def mamba_spec(opts: VllmOptions):
    """The Mamba group's spec as the layer builds it (see the module docstring)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = mamba_state_shapes(opts.layer)
    # _align_hybrid_block_size pads the Mamba page to the attention page
    # (interface.py:1102-1120); MambaBase passes it on as page_size_padded.
    attn_page = opts.block_size * attention_page_per_token()
    padded = attn_page if attn_page != mamba_page(opts.layer) else None
    kind = MambaAttentionBackendEnum.GDN_ATTN if opts.layer == "gdn" else MambaAttentionBackendEnum.MAMBA2
    # MambaBase.get_kv_cache_spec (abstract.py ~72-91): num_speculative_blocks =
    # vllm_config.num_speculative_tokens, for every speculative method.
    spec = MambaSpec(block_size=opts.block_size, shapes=shapes, dtypes=(torch.float32,) * len(shapes),
                     page_size_padded=padded, mamba_type=kind, mamba_cache_mode="align",
                     num_speculative_blocks=opts.spec_tokens)
    # The layer's own override, in this release (MambaMixer2 from 0.32.0; GDN off FlashInfer: none).
    return replace(spec, **compat.prefill_checkpoint_fields(opts.layer))


def build_kv_cache_config(opts: VllmOptions):
    """One shared pool of ``num_blocks``; group 0 full attention, group 1 Mamba."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    bs = opts.block_size
    return KVCacheConfig(
        num_blocks=opts.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=bs, num_kv_heads=TINY["attn_kv_heads"],
                                                            head_size=TINY["head_dim"], dtype=torch.float32)),
            KVCacheGroupSpec(["mamba.0"], mamba_spec(opts)),
        ],
        prefix_cache_retention_interval=opts.retention_interval)
