"""Model configuration: plain data, loadable from ``fixtures/models/*.toml``."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    hidden: int = 32
    # One letter per layer: R = recurrent (conv + gated delta rule), A = attention.
    pattern: str = "RRRA"
    repeats: int = 2
    attn_heads: int = 2
    head_dim: int = 16
    rec_heads: int = 2
    rec_key_dim: int = 8
    rec_value_dim: int = 8
    conv_width: int = 4
    rope_base: float = 10000.0
    seed: int = 0
    init_scale: float = 1.0  # multiplies every weight's std: larger = sharper model
    lm_head_scale: float = 4.0  # keeps logits far from flat so small errors move them

    def __post_init__(self) -> None:
        if set(self.layer_kinds) - {"R", "A"}:
            raise ValueError(f"pattern may only hold R and A, got {self.pattern!r}")
        if "R" not in self.layer_kinds or "A" not in self.layer_kinds:
            raise ValueError("a hybrid model needs at least one R and one A layer")
        if self.conv_width < 2:
            raise ValueError("conv_width must be >= 2")

    @property
    def layer_kinds(self) -> str:
        return self.pattern * self.repeats

    @property
    def num_attn_layers(self) -> int:
        return self.layer_kinds.count("A")

    @property
    def num_rec_layers(self) -> int:
        return self.layer_kinds.count("R")

    @property
    def conv_channels(self) -> int:
        # q, k and v all pass through the short conv, as in GatedDeltaNet.
        return self.rec_heads * (2 * self.rec_key_dim + self.rec_value_dim)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        with open(path, "rb") as fh:
            return cls.from_dict(tomllib.load(fh).get("model", {}))
