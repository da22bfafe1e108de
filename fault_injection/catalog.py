"""Every built-in mutant, loaded: the one place that knows the mutant modules.

Mutant modules import only :mod:`fault_injection.registry` and register on
import; an adapter's mutants (vLLM, SGLang) import their engine only when one
is applied, so loading the catalogue needs no engine installed."""

from __future__ import annotations

from fault_injection import (
    disagg_mutants,
    reference_mutants,
    retention_mutants,
    sglang_mutants,
    spec_mutants,
    tier_mutants,
    vllm_mutants,
    vllm_offload_mutants,
    vllm_pd_mutants,
    window_mutants,
)
from fault_injection.registry import MUTANTS, Mutant

# imported for their registrations (disagg_mutants: target "reference-disagg", the disagg family's)
_MODULES = (reference_mutants, retention_mutants, disagg_mutants, tier_mutants, spec_mutants, vllm_mutants,
            vllm_offload_mutants, vllm_pd_mutants, sglang_mutants, window_mutants)


def all_mutants() -> dict[str, Mutant]:
    """Name -> mutant, every built-in one."""
    return dict(MUTANTS)


def get_mutant(name: str) -> Mutant:
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
    return MUTANTS[name]
