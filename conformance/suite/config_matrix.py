"""Configuration matrices: each check under the configurations that make its
situations reachable, without the user naming options.

An implementation may declare a class attribute ``config_matrix``: a mapping
from a check id, a check family or ``"*"`` (every other check) to a tuple of
option sets.  A run expands each check of its profile into one *variant* per
option set, with its own id (``mid-block-hits[prefix_match_unit=1]``; the empty
set keeps the plain id), its own result in results.json, JUnit and HTML, and
its own expectation (an entry for the variant id, or the check's entry with a
``when`` rule on those options).

- The user's ``--option``s win: a key the user set is dropped from every set,
  and sets that then coincide run once.
- A variant draws exactly what its check draws: it keeps the check's seed
  (its index in the profile) and its generator; only the implementation's
  options differ.
- A variant id names its options, so a repro, a worker or ``--check`` finds
  the variant again by id alone (:func:`parse_variant_id`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from conformance.errors import UsageError
from conformance.generate.spec import CheckSpec


def format_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)) and str(value) and "," not in str(value) and "]" not in str(value):
        return str(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def parse_value(text: str):
    if text == "none":
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    if text[:1] in "{[\"":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def variant_id(base: str, options: dict) -> str:
    if not options:
        return base
    return f"{base}[{','.join(f'{k}={format_value(v)}' for k, v in options.items())}]"


def parse_variant_id(check_id: str) -> tuple[str, dict]:
    """``"a[k=v,l=w]"`` -> ``("a", {"k": v, "l": w})``; a plain id has no options."""
    if not check_id.endswith("]") or "[" not in check_id:
        return check_id, {}
    base, _, rest = check_id.partition("[")
    options = {}
    for part in _split(rest[:-1]):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UsageError(f"check {check_id!r}: expected id[key=value,...]")
        options[key] = parse_value(value)
    return base, options


def _split(text: str) -> list[str]:
    """Split on commas outside JSON brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


# Variant keys the harness takes for itself, never passed to the implementation: the model fixture the check
# runs on (a check of window layers on another window pattern: vLLM builds its groups from the model,
# gpt-oss's alternating layers or Gemma 3's five local per global) and the KV pool it asks for (vLLM gives
# each layer group its own blocks of the one pool: Gemma 3's shape holds six tables where the reference holds
# one).  The variant then draws from that model and pool: its id says so.
HARNESS_KEYS = {"model": str, "num_kv_blocks": int}


def variant(spec: CheckSpec, options: dict) -> CheckSpec:
    """The check under ``options`` (added to, and overriding, the check's own); ``model`` and
    ``num_kv_blocks`` (:data:`HARNESS_KEYS`) set what the check runs on instead."""
    if not options:
        return spec
    rest = {k: v for k, v in options.items() if k not in HARNESS_KEYS}
    fields: dict[str, Any] = {}
    for key, kind in HARNESS_KEYS.items():
        if key in options:
            value = options[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise UsageError(f"check {spec.id!r}: {key} must be a {kind.__name__}, got {value!r}")
            fields[key] = value
    return replace(spec, id=variant_id(spec.id, options), options={**spec.options, **rest}, **fields)


def option_sets(factory, spec: CheckSpec) -> tuple[dict, ...]:
    """The option sets ``factory`` declares for this check (``({},)`` when none)."""
    matrix = getattr(factory, "config_matrix", None) or {}
    for key in (spec.id, spec.family, "*"):
        if key in matrix:
            return tuple(dict(s) for s in matrix[key]) or ({},)
    return ({},)


def expand(planned: list[tuple[int, CheckSpec]], factory, user_options: dict) -> list[tuple[int, CheckSpec]]:
    """``[(index, spec)]`` -> ``[(index, variant)]``: every check once per option
    set, in the matrix's order, keeping its index (its seed).  A check named
    with a variant id is not expanded again."""
    out: list[tuple[int, CheckSpec]] = []
    for index, spec in planned:
        if spec.id != parse_variant_id(spec.id)[0]:
            out.append((index, spec))
            continue
        seen: list[dict] = []
        for options in option_sets(factory, spec):
            options = {k: v for k, v in options.items() if k not in user_options}
            if options not in seen:
                seen.append(options)
                out.append((index, variant(spec, options)))
    return out
