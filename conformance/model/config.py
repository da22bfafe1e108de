"""Model configuration: plain data, loadable from ``fixtures/models/*.toml``."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path

#: The model fixtures a check may name (``CheckSpec.model``): ``<name>.toml`` here.
MODELS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "models"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    hidden: int = 32
    # One letter per layer: R = recurrent (conv + gated delta rule), A = full
    # attention, W = sliding-window attention (rotary, reads the last ``window``
    # positions: a query at q sees keys [q - window + 1, q], vLLM's
    # ``sliding_window``).
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
    # The window of each W layer, in layer order, cycled (one value: every W
    # layer's).  Empty for a model without W layers.  Added last, so that a
    # model without windows keeps its fields, its weights and its draws.
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.windows, list):  # from TOML or JSON
            object.__setattr__(self, "windows", tuple(self.windows))
        if set(self.layer_kinds) - {"R", "A", "W"}:
            raise ValueError(f"pattern may only hold R, A and W, got {self.pattern!r}")
        if len(set(self.layer_kinds)) < 2:
            raise ValueError("a hybrid model needs layers of at least two kinds (R, A, W)")
        if ("W" in self.layer_kinds) != bool(self.windows):
            raise ValueError("windows must be given exactly when the pattern holds W layers")
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 2 for w in self.windows):
            raise ValueError(f"every window must be an integer >= 2, got {self.windows!r}")
        if self.conv_width < 2:
            raise ValueError("conv_width must be >= 2")

    @property
    def layer_kinds(self) -> str:
        return self.pattern * self.repeats

    @property
    def num_attn_layers(self) -> int:
        return self.layer_kinds.count("A")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: its window (W layers), 0 for the others."""
        it, out = 0, []
        for kind in self.layer_kinds:
            if kind == "W":
                out.append(self.windows[it % len(self.windows)])
                it += 1
            else:
                out.append(0)
        return tuple(out)

    @property
    def window_groups(self) -> tuple[int, ...]:
        """The window of each window group, in order of first appearance: the W
        layers of one window form one group, with one block table
        (``RequestStep.window_tables[g]``), as vLLM's coordinator groups the
        layers of one ``SlidingWindowSpec``."""
        return tuple(dict.fromkeys(w for w in self.layer_windows if w))

    def window_facts(self) -> dict:
        """What a cache is told of a model with window layers (``ImplConfig.windows``, ``layer_kinds``,
        ``layer_windows``); nothing for a model without them (its ImplConfig stays what it was)."""
        if not self.window_groups:
            return {}
        return {"windows": self.window_groups, "layer_kinds": self.layer_kinds, "layer_windows": self.layer_windows}

    def window_group_layers(self, group: int) -> int:
        """How many W layers window group ``group`` holds."""
        return sum(1 for w in self.layer_windows if w == self.window_groups[group])

    @property
    def num_rec_layers(self) -> int:
        return self.layer_kinds.count("R")

    @property
    def conv_channels(self) -> int:
        # q, k and v all pass through the short conv, as in GatedDeltaNet.
        return self.rec_heads * (2 * self.rec_key_dim + self.rec_value_dim)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.windows:
            d["windows"] = list(self.windows)
        else:  # a model without windows writes what it wrote before they existed
            del d["windows"]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def fixture(cls, name: str) -> ModelConfig:
        """The model ``fixtures/models/<name>.toml``."""
        return _fixture(name)

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        with open(path, "rb") as fh:
            return cls.from_dict(tomllib.load(fh).get("model", {}))


@cache
def _fixture(name: str) -> ModelConfig:
    path = MODELS_DIR / f"{name}.toml"
    if not path.exists():
        raise ValueError(f"no model fixture {name!r} (fixtures/models/{name}.toml)")
    return ModelConfig.load(path)
