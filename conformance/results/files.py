"""Writing report files so that a reader never sees half of one: a run killed
mid-write leaves the previous complete version."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def finite(obj):
    """``obj`` with every non-finite float replaced by a string ("inf",
    "-inf", "nan"): strict JSON has no Infinity or NaN, and a reader in
    another language rejects them (docs/reports.md)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict_json(obj, **kwargs) -> str:
    """JSON that every parser reads: non-finite floats as strings, ``allow_nan=False``."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
