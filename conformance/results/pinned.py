"""Pinned repros: the file a known defect names, read as data.

Two shapes, told apart by ``schema``:

- a cache-level repro (``hybrid-cache-conformance/repro``, docs/repro-format.md):
  operations replayed on a fresh session, without Hypothesis;
- an engine-level repro (``hybrid-cache-conformance/engine-repro``): one engine
  check (``run --impl vllm-engine --check ID``) with the profile, seed and
  options it ran under.  An engine check is a fixed workload (no fuzzing: its
  prompts come from the seed), so running it again is its replay.

Both record the failure they pin (``failure``: kind and message) and the
facts a defect's conditions are judged on (``facts``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conformance.errors import CompareInputError, ReproFormatError

ENGINE_SCHEMA = "hybrid-cache-conformance/engine-repro"
ENGINE_VERSION = 1


@dataclass
class Pinned:
    path: Path
    level: str  # "cache" | "engine"
    version: str
    failure: dict
    facts: dict
    doc: dict = field(default_factory=dict)
    repro: object = None  # the parsed cache-level Repro


def load_any(path: Path) -> Pinned:
    from conformance.inputs import read_input
    from conformance.results.facts import facts_of
    from conformance.results.repro import SCHEMA, parse

    text = read_input(path, CompareInputError)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CompareInputError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CompareInputError(f"{path}: not a repro (a JSON object)")
    facts = doc.get("facts")
    if facts is not None and not isinstance(facts, dict):
        raise CompareInputError(f"{path}: facts: must be an object")
    if doc.get("schema") == ENGINE_SCHEMA:
        return _engine(path, doc, facts)
    if doc.get("schema") != SCHEMA:
        raise CompareInputError(f"{path}: schema: must be {SCHEMA!r} or {ENGINE_SCHEMA!r}, got "
                                f"{doc.get('schema')!r}")
    try:
        repro = parse(doc, str(path))
    except ReproFormatError as exc:
        raise CompareInputError(f"{path}: {exc}") from None
    from dataclasses import asdict

    return Pinned(Path(path), "cache", repro.implementation_version, dict(repro.failure),
                  facts if facts is not None else facts_of(asdict(repro.impl_config)), doc, repro)


def _engine(path, doc: dict, facts) -> Pinned:
    if doc.get("schema_version") != ENGINE_VERSION:
        raise CompareInputError(f"{path}: schema_version: {doc.get('schema_version')!r} is not supported "
                                f"(this harness reads {ENGINE_VERSION})")
    for key, typ in (("check", str), ("profile", str), ("seed", int), ("options", dict), ("failure", dict)):
        if not isinstance(doc.get(key), typ) or isinstance(doc.get(key), bool):
            raise CompareInputError(f"{path}: {key}: missing or not a {typ.__name__}")
    return Pinned(Path(path), "engine", str(doc.get("implementation_version", "")), dict(doc["failure"]),
                  facts if facts is not None else dict(doc["options"]), doc)


def engine_repro_document(check, result, options: dict, facts: dict) -> dict:
    """The engine-level repro of one failed engine check (written by ``run --impl vllm-engine``)."""
    return {"schema": ENGINE_SCHEMA, "schema_version": ENGINE_VERSION,
            "title": f"{check.id}: {check.failure.kind} failure on {result.implementation}",
            "implementation": result.implementation, "implementation_version": result.implementation_version,
            "impl": result.impl_spec, "check": check.id, "profile": result.profile, "seed": result.seed,
            "options": options, "facts": facts,
            "failure": {"kind": check.failure.kind, "message": check.failure.message},
            "replay": f"hybrid-conformance run --impl vllm-engine --profile {result.profile} --seed {result.seed} "
                      f"--check {check.id}"}
