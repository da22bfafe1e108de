"""What vLLM's engine core does before it builds the scheduler, for one configuration.

A real deployment never runs a scheduler the engine would have refused to
start: ``EngineCore._initialize_kv_caches`` resolves the KV cache layout,
checks that the pool holds one request of ``max_model_len``
(``check_enough_kv_cache_memory``) and resolves the hash block size and the
grain of cache hits onto the configs.  :func:`start` does the same, through
:mod:`.compat` for what differs between releases, and picks ``max_model_len``
as vLLM's own auto-fit does (``--max-model-len -1``): the largest length the
start-up check accepts for the pool, so every configuration the suite runs is
one vLLM would start.  A ``max_model_len`` the user asks for is checked as
asked, and refused (ValueError, a usage error) when vLLM would refuse it.

The pool and the length it settled on are stated by :meth:`Startup.describe`,
which the adapter reports with every check's result (``engine_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import conformance.adapters.vllm.compat as compat
from conformance.adapters.vllm.config import (
    MAX_MODEL_LEN_CEILING,
    VllmOptions,
    build_kv_cache_config,
    build_vllm_config,
    layer_specs,
)


@dataclass
class Startup:
    """The configs a scheduler is built from, as the engine core left them."""

    vllm_config: Any  # vllm.config.VllmConfig (its fields move between releases)
    kv_cache_config: Any  # vllm.v1.kv_cache_interface.KVCacheConfig
    opts: VllmOptions  # with max_model_len settled
    max_model_len: int
    fitted: bool  # max_model_len was fitted to the pool (not asked for)
    layout: str

    def describe(self) -> dict:
        groups = self.kv_cache_config.kv_cache_groups
        per_request = {}
        for g in groups:
            spec = g.kv_cache_spec
            pages = -(-spec.max_memory_usage_bytes(self.vllm_config) // spec.page_size_bytes)
            per_request[type(spec).__name__] = pages
        from conformance.adapters.vllm.config import Groups

        roles = Groups.of(self.kv_cache_config)
        mamba = groups[roles.mamba].kv_cache_spec if roles.mamba is not None else None
        return {"engine": compat.installed().build, "version": compat.installed().version,
                "num_blocks": self.kv_cache_config.num_blocks, "usable_blocks": self.kv_cache_config.num_blocks - 1,
                "block_size": self.opts.block_size, "hash_block_size": self.opts.prefix_match_unit,
                "max_model_len": self.max_model_len,
                "max_model_len_from": "fitted to the pool (vLLM's start-up check)" if self.fitted else "asked for",
                "blocks_per_max_len_request": per_request, "kv_cache_layout": self.layout,
                "mamba_cache_mode": self.vllm_config.cache_config.mamba_cache_mode,
                "prefill_checkpoint_blocks": mamba.num_prefill_checkpoint_blocks if mamba else None,
                "prefill_checkpoint_alignment": mamba.prefill_checkpoint_alignment if mamba else None,
                "window_groups": [(g.kv_cache_spec.sliding_window, g.layer_names) for g in groups
                                  if hasattr(g.kv_cache_spec, "sliding_window")],
                "mamba_groups": [g.layer_names for i, g in enumerate(groups)
                                 if i == roles.mamba or i in roles.shadow],
                "retention_interval": self.opts.retention_interval}


def _specs(kv_cache_config) -> dict:
    return {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}


def _pool_bytes(kv_cache_config) -> int:
    """The memory a pool of ``num_blocks`` stands for: one page per block.  The
    groups' pages are equal (the Mamba page is padded to the attention page)
    and each group has one layer, so one tensor backs both groups, as in
    ``get_kv_cache_config_from_groups``."""
    pages = {g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups}
    assert len(pages) == 1, pages
    # One page per layer of a group: every group holds as many layers (vLLM pads them to that).
    layers = {len(g.layer_names) for g in kv_cache_config.kv_cache_groups}
    assert len(layers) == 1, layers
    return kv_cache_config.num_blocks * pages.pop() * layers.pop()


def accepts(vllm_config, kv_cache_config, max_model_len: int) -> str | None:
    """None when vLLM's start-up check accepts ``max_model_len`` for this pool, else its message."""
    check = compat.startup_check()
    model = vllm_config.model_config
    saved = model.max_model_len
    model.max_model_len = max_model_len  # as vLLM's own estimate_max_model_len probes lengths
    try:
        check(vllm_config, _specs(kv_cache_config), _pool_bytes(kv_cache_config))
    except ValueError as exc:
        return str(exc)
    finally:
        model.max_model_len = saved
    return None


def fit_max_model_len(vllm_config, kv_cache_config, ceiling: int = MAX_MODEL_LEN_CEILING) -> int:
    """The largest length up to ``ceiling`` the start-up check accepts (0: none),
    found as vLLM's ``estimate_max_model_len`` finds it, by bisection."""
    if accepts(vllm_config, kv_cache_config, 1) is not None:
        return 0
    lo, hi = 1, ceiling
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if accepts(vllm_config, kv_cache_config, mid) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def start(opts: VllmOptions, kv_transfer_config=None) -> Startup:
    """The configs for a scheduler of these options, checked as vLLM checks them at start-up."""
    probe = build_vllm_config(replace(opts, max_model_len=opts.max_model_len or MAX_MODEL_LEN_CEILING),
                              kv_transfer_config)
    layout = compat.resolve_kv_cache_layout(probe, layer_specs(opts).values())
    probe.cache_config.kv_cache_layout = layout  # as the engine core records it, before planning
    kv_cache_config = build_kv_cache_config(opts, probe)
    if opts.max_model_len is None:
        length = fit_max_model_len(probe, kv_cache_config)
        if length == 0:
            raise ValueError(f"vLLM would not start with {opts.num_blocks} blocks of {opts.block_size} tokens: "
                             f"{accepts(probe, kv_cache_config, 1)}")
    else:
        length = opts.max_model_len
        refused = accepts(probe, kv_cache_config, length)
        if refused is not None:
            raise ValueError(f"max_model_len {length} with {opts.num_blocks} blocks of {opts.block_size} tokens: "
                             f"vLLM's start-up check refuses it: {refused}")
    settled = replace(opts, max_model_len=length)
    vllm_config = build_vllm_config(settled, kv_transfer_config)
    vllm_config.cache_config.kv_cache_layout = layout  # as the engine core records it
    kv_cache_config = build_kv_cache_config(settled, vllm_config)
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    compat.resolve_engine_fields(vllm_config, kv_cache_config)
    return Startup(vllm_config, kv_cache_config, settled, length, opts.max_model_len is None, layout)
