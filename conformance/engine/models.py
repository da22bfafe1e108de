"""Tiny random-weight hybrid models for the engine checks, built locally.

No hub: a model is a JSON fixture in ``fixtures/models/`` (a ``transformers``
config class, its keyword arguments, a seed and a dtype).  At first use it is
written with ``save_pretrained`` into a cache folder named by a hash of the
fixture, so a changed fixture never reuses stale weights, and two processes
(the engine worker and the transformers reference) read the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
DEFAULT_CACHE = Path(os.environ.get("HCC_MODEL_CACHE", "~/.cache/hybrid-cache-conformance/models")).expanduser()
# Bumped when the way weights are written changes (so caches are rebuilt).
BUILD_VERSION = 1


@dataclass(frozen=True)
class ModelFixture:
    name: str
    spec: dict

    @property
    def dtype(self) -> str:
        return self.spec.get("dtype", "float32")

    @property
    def vocab_size(self) -> int:
        return int(self.spec["config"]["vocab_size"])

    @property
    def recurrent_kind(self) -> str:
        return self.spec.get("recurrent_kind", "")

    @property
    def digest(self) -> str:
        blob = json.dumps({"spec": self.spec, "v": BUILD_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def info(self) -> dict:
        return {"name": self.name, "architecture": self.spec["architecture"], "dtype": self.dtype,
                "recurrent_kind": self.recurrent_kind, "digest": self.digest,
                "layer_types": self.spec["config"].get("layer_types"), "vocab_size": self.vocab_size}


def load_fixture(name_or_path: str) -> ModelFixture:
    path = Path(name_or_path)
    if not path.suffix:
        path = FIXTURES / f"{name_or_path}.json"
    return ModelFixture(name=path.stem, spec=json.loads(path.read_text()))


def available() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.json"))


def ensure_model(fixture: ModelFixture | str, cache_dir: Path | str | None = None) -> Path:
    """The folder holding the fixture's weights, building it on first use."""
    if isinstance(fixture, str):
        fixture = load_fixture(fixture)
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE
    out = root / f"{fixture.name}-{fixture.digest}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    import transformers

    spec = fixture.spec
    config = getattr(transformers, spec["config_class"])(**spec["config"])
    model_cls = getattr(transformers, spec["architecture"])
    # Fixed seed: the weights are a pure function of the fixture.
    torch.manual_seed(int(spec.get("seed", 0)))
    model = model_cls(config)
    # Weights are stored in the dtype the engine runs in, so the transformers
    # reference (which upcasts them) and the engine see the very same numbers.
    model = model.to(getattr(torch, fixture.dtype))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / "fixture.json").write_text(json.dumps(spec, indent=2))
    # Atomic publish: a concurrent builder either wins or finds it done.
    try:
        tmp.rename(out)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
