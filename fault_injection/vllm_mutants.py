"""Seeded bugs in the vLLM adapter's stack, applied at run time to one adapter
instance (no vLLM code is copied or edited: each mutant wraps one decision).

``VLLM_MUTANTS[name](adapter) -> adapter`` patches a built
:class:`conformance.adapters.vllm.VllmCache`; the same mutants are registered
in :mod:`fault_injection.registry` (target ``"vllm"``) as factory wrappers, so
``--impl vllm --mutant NAME`` works once the registry loads this module.  The
suite must catch each through its generic checks (logits against the no-cache
reference, invariants), never through a check written for one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fault_injection.registry import instance_mutant, register


def _check(adapter) -> None:
    if not hasattr(adapter, "scheduler") or not hasattr(adapter, "runner"):
        raise TypeError(f"vLLM mutants apply to VllmCache instances, not {type(adapter).__name__}")


def state_wrong_position(adapter):
    """SNAP: on a prefix hit the model runner takes the recurrent state from one
    block column too early (``(num_computed - 1) // B - 1``), as a worker whose
    Mamba hit index is off by one would: the request continues from the state
    of an earlier position, the never-written null block, or a fresh state."""
    _check(adapter)
    runner = adapter.runner
    original = type(runner).prev_state_idx

    def prev_state_idx(self, rid, num_computed):
        hit = rid not in self.mamba_state_idx and num_computed > 0  # a new request starting past 0
        prev = original(self, rid, num_computed)
        return prev - 1 if hit else prev

    runner.prev_state_idx = prev_state_idx.__get__(runner)
    return adapter


def groups_not_reconciled(adapter):
    """GROUPS: the hybrid coordinator stops reconciling the Mamba group with the
    attention group: the Mamba finder's (shorter) hit no longer shortens the
    common hit, so ``num_computed_tokens`` advances to the attention hit while
    no recurrent state exists there (the LMCache#2845 class: attention restored,
    recurrent state not)."""
    _check(adapter)
    from vllm.v1.kv_cache_interface import MambaSpec

    coord = adapter.scheduler.kv_cache_manager.coordinator
    for idx, group in enumerate(coord.attention_groups):
        if not isinstance(group.spec, MambaSpec):
            continue
        base: Any = group.manager_cls  # a class known at run time only

        class Unreconciled(base):  # a subclass per adapter: vLLM's class itself is not touched
            @classmethod
            def find_longest_cache_hit(cls, *args, max_length, **kw):
                blocks, _ = super().find_longest_cache_hit(*args, max_length=max_length, **kw)
                return blocks, max_length

        coord.attention_groups[idx] = group._replace(manager_cls=Unreconciled)
    return adapter


def local_tail_kept(adapter):
    """TIER: when an external hit is longer than a local hit that ends inside a
    block, the scheduler compares the tiers on the block-rounded local hit and
    lets the external one win, but keeps the local blocks it rounded away (the
    sub-block tail is never released): the request adopts the *cached* partial
    blocks, and the external load then writes the later KV and recurrent state
    into blocks the prefix cache still registers for the shorter prefix.
    Needs the store connector and sub-block matching: runs of this mutant
    turn both on."""
    _check(adapter)
    manager = adapter.scheduler.kv_cache_manager
    manager.truncate_computed_blocks = lambda blocks, num_computed_tokens: blocks  # instance attribute only
    return adapter


VLLM_MUTANTS: dict[str, Callable] = {
    "vllm-state-wrong-position": state_wrong_position,
    "vllm-groups-not-reconciled": groups_not_reconciled,
    "vllm-local-tail-kept": local_tail_kept,
}




# The configuration each buggy code path needs to run at all: the tail a
# longer external hit should release exists only with a tier and sub-block
# matching (vLLM's default matches whole blocks).
# GDN's spec (no prefill checkpoint block): under MambaMixer2's, unmutated vLLM
# already fails with sub-block matching (docs/vllm-adapter.md, "What it
# found"), and a mutant is measured only where the real code conforms.
OPTIONS = {"vllm-local-tail-kept": {"connector": True, "prefix_match_unit": 1, "layer": "gdn"}}

for _name, _apply in VLLM_MUTANTS.items():
    register(_name, (_apply.__doc__ or "X:").split(":")[0].strip(), target="vllm",
             options=OPTIONS.get(_name))(instance_mutant(_name, _apply, "vllm"))
