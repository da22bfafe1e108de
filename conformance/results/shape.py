"""The shape of a results.json read back (``compare``, ``matrix``, the HTML of
several runs): every field those readers use, with its JSON type, so that a
damaged or hand-edited file is refused with one line naming the field
(exit 2) instead of a traceback deep inside a reader.  Unknown keys (from a
newer harness) pass; a field that is there must have its type (``null`` is
accepted where the writer writes it)."""

from __future__ import annotations

from conformance.errors import CompareInputError

_NUMBER = (int, float)

RUN = {"implementation": str, "implementation_version": str, "seed": int, "profile": str, "started": str,
       "finished": str, "interrupted": bool, "crashed": str, "impl_spec": str, "implementation_build": str,
       "model": dict, "impl_config": dict, "mutant": str, "fault_names": list, "faults": dict, "not_run": list,
       "metrics": dict, "expectations": dict, "defect_replays": list, "coverage": dict, "summary": dict,
       "triage": dict}
CHECK = {"id": str, "family": str, "status": str, "description": str, "options": dict, "examples": int,
         "test_cases": int, "operations": int, "seconds": _NUMBER, "coverage": dict, "failure": dict, "reason": str,
         "metrics": dict, "notes": list, "facts": dict, "known_defects": list, "engine_config": dict}
FAILURE = {"kind": str, "message": str, "operations": list, "events": list, "repro": str,
           "examples_to_failure": int, "test_cases_to_failure": int, "seconds_to_failure": _NUMBER,
           "impl_config": dict, "defect": str}

_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "a list", dict: "an object",
          _NUMBER: "a number"}


def _fields(doc: dict, types: dict, where: str) -> None:
    for key, want in types.items():
        value = doc.get(key)
        if value is None:
            continue
        # bool is an int subclass: ``"seed": true`` is not a seed
        wrong = not isinstance(value, want) or (isinstance(value, bool) and want is not bool)
        if wrong:
            raise CompareInputError(f"{where}{key}: must be {_NAMES[want]}, got {type(value).__name__}")


def check_results_shape(doc: dict) -> None:
    """Raise CompareInputError naming the first field of ``doc`` (a results.json,
    upgraded to the current version) that is not what a results.json holds."""
    _fields(doc, RUN, "")
    for i, c in enumerate(doc["checks"]):
        where = f"checks[{i}]."
        if not isinstance(c, dict):
            raise CompareInputError(f"checks[{i}]: must be an object, got {type(c).__name__}")
        for key in ("id", "status"):
            if not isinstance(c.get(key), str):
                raise CompareInputError(f"{where}{key}: missing (expected a string)")
        _fields(c, CHECK, where)
        if c.get("failure") is not None:
            _fields(c["failure"], FAILURE, f"{where}failure.")
        for key, v in (c.get("coverage") or {}).items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise CompareInputError(f"{where}coverage.{key}: must be an integer, got {type(v).__name__}")
        for key in ("notes", "known_defects"):
            for k, item in enumerate(c.get(key) or []):
                want = str if key == "notes" else dict
                if not isinstance(item, want):
                    raise CompareInputError(f"{where}{key}[{k}]: must be {_NAMES[want]}, got {type(item).__name__}")
    for key in ("not_run", "fault_names"):
        for k, item in enumerate(doc.get(key) or []):
            if not isinstance(item, str):
                raise CompareInputError(f"{key}[{k}]: must be a string, got {type(item).__name__}")
    for k, item in enumerate(doc.get("defect_replays") or []):
        if not isinstance(item, dict):
            raise CompareInputError(f"defect_replays[{k}]: must be an object, got {type(item).__name__}")
