"""What a known defect's conditions are judged on: the *facts* of one check's
configuration (conformance.results.defects)."""

from __future__ import annotations


def facts_of(impl_config: dict | None, extra: dict | None = None) -> dict:
    """What a signature's conditions are judged on: the options a check ran
    with, its pool and block sizes, and what the implementation derives from
    them (``extra``: an adapter's ``defect_facts``, e.g. vLLM's sub_block)."""
    cfg = impl_config or {}
    facts = dict(cfg.get("options") or {})
    for key in ("block_size", "num_kv_blocks", "num_state_slots"):
        if cfg.get(key) is not None:
            facts[key] = cfg[key]
    facts.update(extra or {})
    return facts


def implementation_facts(factory, impl_config) -> dict:
    """The facts of one configuration: :func:`facts_of` plus the
    implementation's own ``defect_facts(config)`` (an optional class method
    that names what its options mean, so that a condition need not spell out
    every way of writing an option)."""
    from dataclasses import asdict

    derive = getattr(factory, "defect_facts", None)
    extra = {}
    if callable(derive):
        try:
            extra = dict(derive(impl_config) or {})
        except (ValueError, TypeError):
            extra = {}
    return facts_of(asdict(impl_config), extra)
