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
- ``KimiK3DeltaAttention.get_kv_cache_spec`` (models/kimi_k3/nvidia/kda.py:901-909,
  ``layer="kda"``): the GDN base spec (``mamba_type`` GDN_ATTN, inherited) with
  one prefill checkpoint block at alignment 16 when the prefill backend is
  FlashKDA (``kda_prefill_checkpoint_alignment``, layers/mamba/kda_checkpoint.py:9-10;
  FlashKDA is what ``resolve_kda_prefill_backend`` picks on CUDA SM90+, kda.py:486-526),
  state shapes from ``MambaStateShapeCalculator.kda_state_shape`` (one conv state
  over q, k and v, equal thirds, which the forward splits, kda.py:1197; a
  ``(heads, d, d)`` recurrent state) and dtypes from ``kda_state_dtype``: the
  recurrent state float32 when ``mamba_ssm_cache_dtype`` is "auto" (mamba_utils.py:133-149).
  KDA does not override ``get_prefill_checkpoint_alignment``, so the block size is
  not rounded to 16 (platforms/interface.py:1090-1094): with this model's block
  of 8 a checkpoint 8 tokens after a chunk's start is one FlashKDA cannot export.
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
# Two Mamba groups beside attention: MambaMixer2's and KDA's, in that order or the other.  vLLM's scheduler
# takes the prefill checkpoint alignment of the first Mamba group only ("TODO: Support models with multiple
# Mamba specs that require different prefill checkpoint alignments", v1/core/sched/scheduler.py:435-443).
# The harness's recurrent layers are the KDA group's; the MambaMixer2 group is scheduled, allocated and
# reconciled by vLLM as in a real model, but its memory is not the harness's (the contract has one state
# slot per request): see :class:`Groups`.
MIXED_LAYERS = {"mamba2+kda": ("mamba2", "kda"), "kda+mamba2": ("kda", "mamba2")}
JUDGED_IN_MIXED = "kda"
LAYERS = ("mamba2", "gdn", "kda", *MIXED_LAYERS)
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
      (:mod:`.offloading`; ``offload`` then names the policy); ``offload_chunks``: its CPU tier's size
      in chunks (default :func:`.offloading.host_chunks`, sixteen times the pool).
    - ``layer``: whose ``get_kv_cache_spec`` the Mamba group follows: ``"mamba2"``
      (``MambaMixer2``: one prefill checkpoint block, alignment 1), ``"gdn"``
      (Gated DeltaNet as it runs on a CPU or with Triton: none), ``"kda"``
      (Kimi-K3's KDA under FlashKDA's prefill: one checkpoint block, alignment 16), or two
      Mamba groups, ``"mamba2+kda"`` / ``"kda+mamba2"`` (the first is the scheduler's
      first Mamba group; the harness's recurrent layers are KDA's, :data:`MIXED_LAYERS`).
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
    # The harness model's layers when it has window layers (ImplConfig.layer_kinds / layer_windows): vLLM
    # then gets one spec per layer, grouped by its own get_kv_cache_groups (:func:`layer_specs`).
    layer_kinds: str = ""
    layer_windows: tuple[int, ...] = ()

    @property
    def has_mamba(self) -> bool:
        return "R" in self.layer_kinds if self.layer_kinds else True

    offload: str | None = None  # the policy, with connector="offload-lru" / "offload-arc" (.offloading)
    offload_chunks: int | None = None  # the CPU tier's size in chunks (None: .offloading.host_chunks)

    @classmethod
    def from_config(cls, config: ImplConfig) -> VllmOptions:
        o = dict(config.options)
        known = {"prefix_match_unit", "retention_interval", "interval", "admission", "max_num_seqs",
                 "max_model_len", "shared_prefix_checkpoint", "connector", "layer", "spec_tokens", "spec_method",
                 "spec_lookahead_hashes", "offload_chunks"}
        unknown = set(o) - known
        if unknown:
            raise ValueError(f"unknown vLLM adapter options: {sorted(unknown)} (known: {sorted(known)})")
        layer = o.get("layer", "mamba2")
        if layer not in LAYERS:
            raise ValueError(f"unknown layer {layer!r} (expected one of {LAYERS})")
        if "kda" in layer and not compat.since("0.31.0"):
            raise ValueError(f"layer {layer!r} needs vLLM 0.31.0 or later (KDA's prefill checkpoint goes through "
                             f"layers/mamba/checkpoint.py), installed {compat.installed().version}")
        kinds = config.layer_kinds
        if kinds and layer in MIXED_LAYERS:
            raise ValueError(f"layer {layer!r} (two Mamba groups) is not modelled beside window layers")
        bs = hybrid_block_size(config.block_size, layer) if not kinds or "R" in kinds else config.block_size
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
        chunks = o.get("offload_chunks")
        if chunks is not None and (not offload or isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or chunks < 1):
            raise ValueError(f"offload_chunks {chunks!r}: a positive number of chunks, with connector=offload-lru "
                             f"or offload-arc")
        return cls(block_size=bs, num_blocks=config.num_kv_blocks, prefix_match_unit=pmu, offload=offload,
                   offload_chunks=chunks,
                   spec_tokens=spec[0], spec_method=spec[1], spec_lookahead_hashes=spec[2],
                   retention_interval=interval, admission=admission,
                   max_num_seqs=int(o.get("max_num_seqs", 16)), max_model_len=_length(o.get("max_model_len")),
                   shared_prefix_checkpoint=bool(o.get("shared_prefix_checkpoint", False)),
                   connector=connector, layer=layer, layer_kinds=kinds,
                   layer_windows=tuple(config.layer_windows))


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
    if layer == "kda":
        # KimiK3DeltaAttention.get_state_shape (models/kimi_k3/nvidia/kda.py:582-590): heads
        # of head_dim d for q, k and v alike (num_k_heads, head_k_dim default to them).
        return tuple(calc.kda_state_shape(1, t["rec_heads"], t["rec_key_dim"], conv_kernel_size=t["conv_width"]))
    if layer == "gdn":
        # QwenGatedDeltaNetAttention.get_state_shape (qwen_gdn_linear_attn.py:545-556)
        return tuple(calc.gated_delta_net_state_shape(1, t["rec_heads"], t["rec_heads"], t["rec_key_dim"],
                                                      t["rec_value_dim"], t["conv_width"]))
    # MambaMixer2.get_state_shape: heads x head_dim values, a state of size
    # d_state, one group (the harness's heads read keys of rec_key_dim).
    return tuple(calc.mamba2_state_shape(1, t["rec_heads"] * t["rec_value_dim"], 1, t["rec_heads"],
                                         t["rec_value_dim"], t["rec_key_dim"], t["conv_width"]))


_DTYPE_BYTES = 4  # float32 for both groups: only the ratio of the two pages matters


def mamba_state_dtypes(layer: str) -> tuple:
    """The state dtypes of the layer for the adapter's float32 model.  KDA's
    come from vLLM's own ``kda_state_dtype`` (the conv state in the model's
    dtype, the recurrent state float32 on "auto", mamba_utils.py:133-149); the
    others are float32 for both states here too."""
    import torch

    if layer == "kda":
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

        return tuple(MambaStateDtypeCalculator.kda_state_dtype(torch.float32, "auto", "auto"))
    return (torch.float32,) * len(mamba_state_shapes(layer))


def attention_page_per_token() -> int:
    """``FullAttentionSpec(block_size=1, ...).page_size_bytes``: K and V."""
    return 2 * TINY["attn_kv_heads"] * TINY["head_dim"] * _DTYPE_BYTES


def mamba_page(layer: str) -> int:
    """``MambaSpec.page_size_bytes`` before padding (kv_cache_interface.py:1118-1126)."""
    total = 0
    for shape, dtype in zip(mamba_state_shapes(layer), mamba_state_dtypes(layer)):
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += n
    return total


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
    # Two Mamba layouts: the largest page, as for Qwen4Exp's (platforms/interface.py:1050-1056).
    page = max(mamba_page(part) for part in MIXED_LAYERS.get(layer, (layer,)))
    attn_block = align * _cdiv(page, align * attention_page_per_token())
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


ATTN_GROUP, MAMBA_GROUP = 0, 1  # the groups of one attention and one Mamba layer (Groups.plain)


@dataclass(frozen=True)
class Groups:
    """Which KV cache group plays which part for the harness.

    ``attn``: the full-attention group (the harness's attention layers; None for a model without them);
    ``mamba``: the Mamba group whose state the harness's recurrent layers hold (its block ids are state
    slots; None for a model without recurrent layers); ``shadow``: Mamba groups vLLM schedules,
    allocates and reconciles whose memory the harness does not model (the contract has one state slot per
    request); ``windows``: the sliding-window groups, in vLLM's order, and ``window_layers`` the model's W
    layers of each (indices among the W layers: the harness's ``Layout.window_layer_groups``)."""

    attn: int | None = ATTN_GROUP
    mamba: int | None = MAMBA_GROUP
    shadow: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()
    window_layers: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, kv_cache_config) -> Groups:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups
        kind = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else
                 "window" if isinstance(g.kv_cache_spec, SlidingWindowSpec) else "attn") for g in groups]
        attn = [i for i, k in enumerate(kind) if k == "attn"]
        if len(attn) > 1:  # the contract has one full-attention table per request
            raise ValueError(f"vLLM made {len(attn)} full attention groups of this model; the harness has one table")
        mambas = [i for i, k in enumerate(kind) if k == "mamba"]
        judged = next((i for i in mambas if _judged_layer(groups[i].layer_names)), mambas[0] if mambas else None)
        windows = tuple(i for i, k in enumerate(kind) if k == "window")
        # W-layer index of each window layer name ("swa.<layer index>"), in layer order.
        w_layers = sorted({int(n.split(".")[1]) for i in windows for n in groups[i].layer_names})
        window_layers = tuple(tuple(sorted(w_layers.index(int(n.split(".")[1])) for n in groups[i].layer_names))
                              for i in windows)
        return cls(attn[0] if attn else None, judged, tuple(i for i in mambas if i != judged), windows,
                   window_layers)


def _judged_layer(layers: list[str]) -> bool:
    return layers[0] in ("mamba.0", f"{JUDGED_IN_MIXED}.0")


def mamba_spec(opts: VllmOptions, layer: str | None = None):
    """The Mamba group's spec as the layer builds it (see the module docstring)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    layer = layer or opts.layer
    shapes = mamba_state_shapes(layer)
    # _align_hybrid_block_size pads the Mamba page to the attention page
    # (interface.py:1102-1120); MambaBase passes it on as page_size_padded.
    attn_page = opts.block_size * attention_page_per_token()
    padded = attn_page if attn_page != mamba_page(layer) else None
    # KimiK3DeltaAttention keeps GatedDeltaNetAttention's mamba_type (gdn/base.py:50-51).
    kind = MambaAttentionBackendEnum.GDN_ATTN if layer in ("gdn", "kda") else MambaAttentionBackendEnum.MAMBA2
    # MambaBase.get_kv_cache_spec (abstract.py ~72-91): num_speculative_blocks =
    # vllm_config.num_speculative_tokens, for every speculative method.
    spec = MambaSpec(block_size=opts.block_size, shapes=shapes, dtypes=mamba_state_dtypes(layer),
                     page_size_padded=padded, mamba_type=kind, mamba_cache_mode="align",
                     num_speculative_blocks=opts.spec_tokens)
    # The layer's own override, in this release (MambaMixer2 from 0.32.0; GDN off FlashInfer: none).
    return replace(spec, **compat.prefill_checkpoint_fields(layer))


def layer_specs(opts: VllmOptions) -> dict:
    """Layer name -> spec, in the order vLLM groups them (``get_kv_cache_groups`` keeps the order
    of first appearance, kv_cache_planning.py:416-557).  Without window layers: the attention layer, then
    the Mamba layer(s) (one Mamba layout: ``mamba.0``; two: ``<layer>.0`` each, the first the scheduler's
    first Mamba group).  With them (``opts.layer_kinds``): one spec per layer of the harness's model, in its
    order, as the model's layers build theirs: ``Attention.get_kv_cache_spec`` gives a window layer a
    ``SlidingWindowSpec`` of its window (model_executor/layers/attention/attention.py:624-673; gpt-oss makes
    every even layer one, models/gpt_oss.py:175, Gemma 3 the layers its config names "sliding_attention",
    models/gemma3.py:153-155), with the primary block size (one page per block for every group here: the
    same heads and dtype), and the recurrent layers the Mamba spec of ``opts.layer``."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    attn: dict[str, Any] = {"block_size": opts.block_size, "num_kv_heads": TINY["attn_kv_heads"],
                            "head_size": TINY["head_dim"], "dtype": torch.float32}
    specs: dict = {}
    if opts.layer_kinds:
        mamba = mamba_spec(opts) if "R" in opts.layer_kinds else None
        for i, (kind, window) in enumerate(zip(opts.layer_kinds, opts.layer_windows)):
            if kind == "R":
                specs[f"mamba.{i}"] = mamba
            elif kind == "W":
                specs[f"swa.{i}"] = SlidingWindowSpec(**attn, sliding_window=window)
            else:
                specs[f"attn.{i}"] = FullAttentionSpec(**attn)
        return specs
    specs["attn.0"] = FullAttentionSpec(**attn)
    if opts.layer in MIXED_LAYERS:
        for part in MIXED_LAYERS[opts.layer]:
            specs[f"{part}.0"] = mamba_spec(opts, part)
    else:
        specs["mamba.0"] = mamba_spec(opts)
    return specs


def build_kv_cache_config(opts: VllmOptions, vllm_config=None):
    """One shared pool of ``num_blocks``.  Without window layers: one group per layer of
    :func:`layer_specs` (one layer each, as ``_get_kv_cache_groups_uniform_page_size`` groups a model with
    one layer of each spec; tests/test_vllm_kda.py checks it against vLLM's own grouping).  With them: the
    groups vLLM's own ``get_kv_cache_groups`` makes of the model's layers (``vllm_config`` with its KV cache
    layout resolved): Gemma 3's five window layers per full one are five window groups."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    specs = layer_specs(opts)
    if opts.layer_kinds:
        assert vllm_config is not None, "window layers are grouped by vLLM's own grouping"
        groups = compat.kv_cache_groups(vllm_config, specs)
    else:
        groups = [KVCacheGroupSpec([name], spec) for name, spec in specs.items()]
    return KVCacheConfig(num_blocks=opts.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=opts.retention_interval)
