"""The design note's cost model (sections 1 and 2), for choosing a retention
interval from a model's sizes and one's own prices.

- crossover: the sequence length at which one recurrent state costs as much
  memory as the KV of the attention layers, ``S / kv_bytes_per_token``;
- interval: checkpoints every I tokens over a T-token context store T/I states
  and make a request resuming at a random position recompute I/2 tokens, so
  ``cost(I) = (T / I) * S * alpha + (I / 2) * beta``, minimal at
  ``I* = sqrt(2 T S alpha / beta)``.

Defaults are the note's: 3 MiB of state, 1 KiB of KV per token, T = 1M,
alpha = 1e-9 per byte held, beta = 1e-3 per token recomputed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from conformance.model import ModelConfig

NOTE_STATE_BYTES = 3 * 2**20
NOTE_KV_BYTES_PER_TOKEN = 1024.0
NOTE_CONTEXT = 1_000_000
NOTE_ALPHA = 1.0e-9
NOTE_BETA = 1.0e-3


@dataclass(frozen=True)
class CostModel:
    state_bytes: float
    kv_bytes_per_token: float
    context: int = NOTE_CONTEXT
    alpha: float = NOTE_ALPHA
    beta: float = NOTE_BETA

    def __post_init__(self) -> None:
        for name in ("state_bytes", "kv_bytes_per_token", "context", "alpha", "beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def crossover_tokens(self) -> float:
        return self.state_bytes / self.kv_bytes_per_token

    def optimal_interval(self) -> float:
        return math.sqrt(2 * self.context * self.state_bytes * self.alpha / self.beta)

    def total_cost(self, interval: float) -> float:
        return (self.context / interval) * self.state_bytes * self.alpha + (interval / 2) * self.beta

    def plan(self, interval: float) -> dict:
        """Storage and expected recompute of one interval (the note's interval_plan)."""
        return {"interval": interval, "checkpoints": int(self.context // interval),
                "state_gib": int(self.context // interval) * self.state_bytes / 2**30,
                "expected_recompute_tokens": interval / 2, "cost": self.total_cost(interval)}

    def report(self) -> dict:
        i_star = self.optimal_interval()
        return {**asdict(self), "crossover_tokens": self.crossover_tokens(), "optimal_interval": i_star,
                "at_optimum": self.plan(i_star)}


def sizes_of(config: ModelConfig, dtype_bytes: int = 2) -> tuple[float, float]:
    """(recurrent state bytes, attention KV bytes per token) of a whole model:
    every recurrent layer's conv and matrix state, every attention layer's K and V."""
    c = config
    state = c.num_rec_layers * ((c.conv_width - 1) * c.conv_channels + c.rec_heads * c.rec_key_dim * c.rec_value_dim)
    kv = c.num_attn_layers * 2 * c.attn_heads * c.head_dim
    return float(state * dtype_bytes), float(kv * dtype_bytes)


def format_report(r: dict) -> str:
    opt = r["at_optimum"]
    return "\n".join([
        f"cost model: state {r['state_bytes'] / 2**20:,.3f} MiB, KV {r['kv_bytes_per_token']:,.0f} B/token",
        f"  crossover: one state = the KV of {r['crossover_tokens']:,.0f} tokens "
        f"(shorter contexts: the state dominates)",
        f"  context T = {r['context']:,} tokens, alpha = {r['alpha']:g}/byte held, beta = {r['beta']:g}/token "
        f"recomputed",
        f"  optimal interval I* = sqrt(2 T S alpha / beta) = {r['optimal_interval']:,.0f} tokens "
        f"({opt['checkpoints']:,} checkpoints, {opt['state_gib']:.2f} GiB of state, "
        f"{opt['expected_recompute_tokens']:,.0f} tokens expected recompute)",
    ])
