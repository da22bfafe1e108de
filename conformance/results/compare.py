"""Comparing runs: before/after an engine upgrade, or a run against the
expectations file of an engine version.

Both read results.json as plain dicts (the file is the interface: runs from
another machine or an older harness compare the same way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conformance.errors import CompareInputError
from conformance.results.expectations import (  # noqa: F401 - re-exported: the old home of these names
    BAD,
    expected_status,
    find_expectations,
    load_expectations,
)
from conformance.results.triage import compare_with_expectations, format_expectations  # noqa: F401


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
    # (check, reason): ran before (passed or failed), skipped now: no longer checked
    now_skipped: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # skipped now, and not run before either
    nothing_checked: bool = False  # the new run executed no check at all
    warnings: list[str] = field(default_factory=list)  # e.g. the two runs are of different implementations
    # Defects first (by signature, conformance.results.triage): FIXED only where the new run's replay of a
    # pinned repro says so, never because a fuzzing check happened not to meet a defect.
    defects_fixed: list[str] = field(default_factory=list)
    defects_new: list[tuple[str, list[str]]] = field(default_factory=list)  # (NEW title, checks) not in OLD
    defects_still_new: list[tuple[str, list[str]]] = field(default_factory=list)
    known_now_seen: list[str] = field(default_factory=list)  # known defects met now, not before
    known_not_seen_now: list[str] = field(default_factory=list)  # met before, not now (informational)

    @property
    def regressed(self) -> bool:
        # A check that vanished, was skipped, or a situation that stopped
        # occurring hides bugs as surely as a failure does: all are regressions.
        return bool(self.new_failures or self.missing or self.coverage_lost or self.interrupted
                    or self.now_skipped or self.nothing_checked or self.defects_new)


def compare(old: dict, new: dict) -> Comparison:
    o, n = _by_id(old), _by_id(new)
    cmp = Comparison(interrupted=bool(new.get("interrupted")))
    cmp.nothing_checked = not any(c["status"] != "skipped" for c in n.values())
    for key in ("implementation", "impl_spec"):
        a, b = old.get(key), new.get(key)
        if a and b and a != b:
            cmp.warnings.append(f"the runs are of different implementations ({key} {a!r} vs {b!r}): "
                                f"differences may be theirs, not a regression")
            break
    for cid, c in n.items():
        before = o.get(cid)
        if c["status"] == "skipped":
            reason = c.get("reason") or "no reason given"
            if before is not None and before["status"] != "skipped":
                cmp.now_skipped.append((cid, reason))
            else:
                cmp.skipped.append((cid, reason))
        elif c["status"] in BAD:
            if before is None or before["status"] not in BAD:
                cmp.new_failures.append((cid, ((c.get("failure") or {}).get("message") or c["status"])[:300]))
            else:
                cmp.still_failing.append(cid)
        elif before is not None and before["status"] in BAD and c["status"] == "passed":
            cmp.fixed.append(cid)
        if before is None:
            cmp.added.append(cid)
    cmp.missing = [cid for cid in o if cid not in n]
    _compare_defects(cmp, old, new)
    oc, nc = old.get("coverage", {}), new.get("coverage", {})
    for key in sorted(set(oc) | set(nc)):
        a, b = int(oc.get(key, 0)), int(nc.get(key, 0))
        if a != b:
            cmp.coverage_changes.append((key, a, b))
            if a > 0 and b == 0:
                cmp.coverage_lost.append(key)
    return cmp


def signature_groups(result: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(known defect id -> checks, NEW title -> checks) of a run: its triage's
    groups, or, for a run judged by no expectations file, every failure by its title."""
    triage = result.get("triage")
    if triage:
        return ({g["key"]: g["checks"] for g in triage.get("known", [])},
                {g["key"]: g["checks"] for g in triage.get("new", [])})
    from conformance.results.defects import title_of

    new: dict[str, list[str]] = {}
    for c in result.get("checks", []):
        if c.get("status") in BAD:
            f = c.get("failure") or {}
            new.setdefault(title_of(f.get("kind") or c["status"], f.get("message") or ""), []).append(c["id"])
    return {}, new


def _compare_defects(cmp: Comparison, old: dict, new: dict) -> None:
    old_known, old_new = signature_groups(old)
    new_known, new_new = signature_groups(new)
    cmp.defects_fixed = [r["defect"] for r in (new.get("triage") or {}).get("fixed", [])]
    for title, checks in new_new.items():
        (cmp.defects_still_new if title in old_new else cmp.defects_new).append((title, checks))
    cmp.known_now_seen = [d for d in new_known if d not in old_known]
    cmp.known_not_seen_now = [d for d in old_known if d not in new_known and d not in cmp.defects_fixed]


def format_comparison(cmp: Comparison, old_label: str, new_label: str) -> str:
    lines = [f"compare {old_label} -> {new_label}"]
    lines += [f"  WARNING: {w}" for w in cmp.warnings]
    for did in cmp.defects_fixed:
        lines.append(f"  DEFECT FIXED {did} (its pinned repro no longer reproduces in the new run)")
    for title, checks in cmp.defects_new:
        lines.append(f"  DEFECT NEW   {title} ({len(checks)} checks: {', '.join(checks[:6])})")
    for title, checks in cmp.defects_still_new:
        lines.append(f"  still NEW    {title} ({len(checks)} checks)")
    for did in cmp.known_now_seen:
        lines.append(f"  known defect now seen: {did}")
    for did in cmp.known_not_seen_now:
        lines.append(f"  known defect not seen now: {did} (informational: no check met it; not fixed)")
    if cmp.interrupted:
        lines.append("  the new run was interrupted: its results are incomplete")
    if cmp.nothing_checked:
        lines.append("  NOTHING WAS CHECKED in the new run: every check was skipped (or none ran)")
    for cid, msg in cmp.new_failures:
        lines.append(f"  NEW FAILURE  {cid}: {msg}")
    for cid in cmp.missing:
        lines.append(f"  MISSING      {cid} (ran before, not in the new run)")
    for cid, reason in cmp.now_skipped:
        lines.append(f"  NOW SKIPPED  {cid}: {reason} (checked before, not now)")
    for cid, reason in cmp.skipped:
        lines.append(f"  skipped      {cid}: {reason}")
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
