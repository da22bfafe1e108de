"""What one check asks of the generator: the rules it enables, the pool
sizes and lengths it draws, the options it builds the implementation with,
and the coverage counters that must end above zero.  Plain data; the
catalogue of checks lives in :mod:`conformance.suite.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.contract import ImplConfig


@dataclass(frozen=True)
class CheckSpec:
    id: str
    family: str
    description: str
    rules: frozenset[str]  # optional rules enabled besides submit and drain
    required: tuple[str, ...]  # coverage counters that must be > 0
    block_size: int = 4
    num_kv_blocks: int = 64
    num_state_slots: int = 24
    max_prompt_blocks: int = 5
    max_seq_blocks: int = 12
    max_active: int = 3
    max_new_tokens: int = 3
    options: dict = field(default_factory=dict)
    # Observers run after every step (conformance.judge.retention.OBSERVERS); a check
    # with any is skipped for an implementation that declares no retention().
    observe: tuple[str, ...] = ()
    # Observers that run when the implementation declares a retention policy,
    # and are left out (a note says so), never a reason to skip, when it does not.
    observe_when_declared: tuple[str, ...] = ()
    # Runs with the implementation's second tier on (its ``tier_option``); a
    # check with it is skipped for an implementation that has none.
    tier: bool = False
    # Runs prefill and decode on two workers with a transfer between them
    # (conformance.suite.disagg); skipped for an implementation without a
    # disaggregated mode (no ``disagg_factory`` / ``disagg_layouts()``).
    disagg: bool = False
    # Runs with the implementation's speculative decoding on (its ``spec_option``):
    # the harness proposes drafts (rule group "spec"); skipped for an
    # implementation that has none.
    spec: bool = False
    # The model the check runs on, by name (fixtures/models/<name>.toml), instead
    # of the run's (the window family's model has sliding-window layers; every
    # other check keeps the run's model, and its draws).
    model: str | None = None

    @property
    def observers(self) -> tuple[str, ...]:
        """Every observer of the check's sessions (each does nothing for an
        implementation that declares no retention policy)."""
        return self.observe + self.observe_when_declared

    def impl_config(self, **overrides) -> ImplConfig:
        base: dict[str, Any] = {"block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks,
                                "num_state_slots": self.num_state_slots, "options": dict(self.options)}
        if self.model is not None:  # the cache is told the model's window groups
            from conformance.model import ModelConfig

            base.update(ModelConfig.fixture(self.model).window_facts())
        base.update({k: v for k, v in overrides.items() if v is not None})
        return ImplConfig(**base)


# The optional rule groups of the machine (submitting and draining are always on).
EVERY_RULE = frozenset({"continue", "step", "abort", "pressure"})


def mixed() -> CheckSpec:
    """Every rule at once, in a pool small enough to evict."""
    return CheckSpec("mixed", "mixed", "every rule at once", EVERY_RULE, ("prefix_hits",),
                     num_kv_blocks=40, num_state_slots=14)
