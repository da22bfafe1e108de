"""Reading repro files: validation that names the bad field.

A repro file is data only (see ``docs/repro-format.md``).  Nothing in it is
ever executed: operations are parsed with :func:`conformance.harness.ops.op_from_dict`,
the model and implementation configurations with their dataclasses, and a
``module:Class`` implementation named by the file is only imported when the
user asks for it on the command line (``conformance.suite.replay`` decides that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from conformance.contract import ImplConfig
from conformance.errors import FailureKind, ReproFormatError
from conformance.harness.disagg.ops import DisaggSubmit, is_disagg
from conformance.harness.ops import Op, Probe, Submit, op_from_dict
from conformance.inputs import read_input
from conformance.model import ModelConfig

SCHEMA = "hybrid-cache-conformance/repro"
VERSION = 3
# v1 lacked title/upstream/harness; v1 and v2 name the operations "steps" (v3: "operations").
# Every version replays the same way.
SUPPORTED_VERSIONS = (1, 2, 3)


def operations_key(version: int) -> str:
    """Where a file of this version keeps its operations."""
    return "operations" if version >= 3 else "steps"


@dataclass
class Repro:
    path: str
    operations: list[Op]
    model: ModelConfig
    impl_config: ImplConfig
    impl: str  # what --impl said when the failure was found (reference, vllm, module:Class)
    implementation: str
    implementation_version: str
    seed: int
    check: str
    mutant: str | None
    faults: list[str]
    failure: dict  # {"kind", "message"} as recorded; empty for hand-written scenarios without one
    title: str = ""
    upstream: list[str] = field(default_factory=list)
    doc: dict = field(default_factory=dict)
    version: int = VERSION  # the file's schema_version (its operations' key: operations_key)


def load(path: str | Path) -> Repro:
    path = Path(path)
    text = read_input(path, ReproFormatError)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReproFormatError(f"{path}: not JSON: {exc}") from None
    return parse(doc, str(path))


def _need(doc: dict, key: str, types, what: str, optional: bool = False, default=None):
    if key not in doc or doc[key] is None:
        if optional:
            return default
        raise ReproFormatError(f"{key}: missing (expected {what})")
    value = doc[key]
    # bool is an int subclass: a seed of `true` is a mistake, not 1
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ReproFormatError(f"{key}: must be {what}, got {type(value).__name__}")
    return value


def _as_tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def parse(doc, path: str = "<repro>") -> Repro:
    if not isinstance(doc, dict):
        raise ReproFormatError(f"(top level): must be a JSON object, got {type(doc).__name__}")
    schema = doc.get("schema")
    if schema != SCHEMA:
        raise ReproFormatError(f"schema: must be {SCHEMA!r}, got {schema!r}")
    version = doc.get("schema_version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise ReproFormatError(f"schema_version: {version!r} is not supported (this harness reads "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))})")

    model = _parse_model(_need(doc, "model", dict, "an object of model settings", optional=True, default={}))
    impl_config = _parse_impl_config(_need(doc, "impl_config", dict, "an object", optional=True, default={}))
    key = operations_key(version)
    if key == "operations" and "steps" in doc and "operations" not in doc:
        raise ReproFormatError(f"operations: missing (a version {version} file names them 'operations'; 'steps' "
                               f"is the name of versions 1 and 2)")
    operations = _parse_operations(doc.get(key), model.vocab_size, key)

    mutant = _need(doc, "mutant", str, "a mutant name or null", optional=True)
    faults = _need(doc, "faults", list, "a list of fault names", optional=True, default=[])
    for i, f in enumerate(faults):
        if not isinstance(f, str) or not f:
            raise ReproFormatError(f"faults[{i}]: must be a fault name")
    upstream = _need(doc, "upstream", list, "a list of issue references", optional=True, default=[])
    for i, u in enumerate(upstream):
        if not isinstance(u, str) or not u:
            raise ReproFormatError(f"upstream[{i}]: must be a non-empty string such as 'vllm#34587'")
    failure = _need(doc, "failure", dict, "an object with kind and message", optional=True, default={})
    for key in ("kind", "message"):
        if key in failure and not isinstance(failure[key], str):
            raise ReproFormatError(f"failure.{key}: must be a string")
    kinds = [k.value for k in FailureKind]
    if "kind" in failure and failure["kind"] not in kinds:
        # REPRODUCED needs the same kind: a kind no failure has would read as never reproducing
        raise ReproFormatError(f"failure.kind: {failure['kind']!r} is not a failure kind (one of "
                               f"{', '.join(kinds)})")
    return Repro(
        path=path, operations=operations, model=model, impl_config=impl_config,
        impl=_need(doc, "impl", str, "an implementation name", optional=True, default="") or "",
        implementation=_need(doc, "implementation", str, "a string", optional=True, default=""),
        implementation_version=str(doc.get("implementation_version", "")),
        seed=_need(doc, "seed", int, "an integer", optional=True, default=0),
        check=_need(doc, "check", str, "a check id", optional=True, default=""),
        mutant=mutant, faults=list(faults), failure=failure,
        title=_need(doc, "title", str, "a string", optional=True, default=""),
        upstream=list(upstream), doc=doc, version=version)


def _parse_model(data: dict) -> ModelConfig:
    known = {f.name: f for f in fields(ModelConfig)}
    for key, value in data.items():
        if key not in known:
            raise ReproFormatError(f"model.{key}: unknown model setting (known: {', '.join(known)})")
        default = known[key].default
        expected = type(default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if expected is float else \
            isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            raise ReproFormatError(f"model.{key}: must be {expected.__name__}, got {type(value).__name__}")
    try:
        return ModelConfig.from_dict(data)
    except ValueError as exc:
        raise ReproFormatError(f"model: {exc}") from None


def _parse_impl_config(data: dict) -> ImplConfig:
    known = {f.name for f in fields(ImplConfig)}
    for key, value in data.items():
        if key not in known:
            raise ReproFormatError(f"impl_config.{key}: unknown setting (known: {', '.join(sorted(known))})")
        if key == "options":
            if not isinstance(value, dict):
                raise ReproFormatError("impl_config.options: must be an object")
        elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ReproFormatError(f"impl_config.{key}: must be a positive integer")
    return ImplConfig(**{k: v for k, v in data.items() if v is not None})


def _parse_operations(raw, vocab: int, key: str = "operations") -> list[Op]:
    if not isinstance(raw, list) or not raw:
        raise ReproFormatError(f"{key}: must be a non-empty list of operations")
    ops: list[Op] = []
    seen = set()
    for i, d in enumerate(raw):
        try:
            op = op_from_dict(d)
        except ValueError as exc:
            raise ReproFormatError(_at(key, i, d, str(exc))) from None
        if ops and is_disagg(op) != is_disagg(ops[0]):
            raise ReproFormatError(f"{key}[{i}].op: disaggregated operations (disagg-*) cannot mix with "
                                   f"single-worker ones")
        if isinstance(op, (Submit, DisaggSubmit)):
            if op.request_id in seen:
                raise ReproFormatError(f"{key}[{i}].request_id: {op.request_id!r} is submitted twice")
            seen.add(op.request_id)
        if isinstance(op, Submit):
            bad = [t for t in op.prompt if t >= vocab]
            if bad:
                raise ReproFormatError(f"{key}[{i}].prompt: token {bad[0]} is outside the model's vocabulary "
                                       f"of {vocab}")
            # ``continues`` is coverage bookkeeping only: a minimized sequence may
            # have dropped the earlier request, and the replay is still valid.
        if ops and isinstance(ops[-1], Probe):
            raise ReproFormatError(f"{key}[{i}]: the probe ({key}[{i - 1}]) ends a session: it must be the last "
                                   f"operation")
        ops.append(op)
    return ops


def _at(key: str, i: int, d, message: str) -> str:
    """op_from_dict names fields as ``submit.prompt``; a file reader wants ``operations[3].prompt``."""
    name = d.get("op") if isinstance(d, dict) else None
    if name and message.startswith(f"{name}."):
        return f"{key}[{i}]." + message[len(name) + 1:]
    if message.startswith("op:"):
        return f"{key}[{i}].op:" + message[3:]
    if name and message.startswith(f"{name}:"):
        return f"{key}[{i}]:" + message[len(name) + 1:]
    return f"{key}[{i}]: {message}"
