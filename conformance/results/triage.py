"""Triage: every failure of a run matched against its engine version's known
defects and per-check expectations, grouped by signature.

A failure is one of:

- **known defect D** (or known limitation D): its kind, message and the
  check's facts meet D's signature (``conformance.results.defects``), whatever
  the check and the seed;
- **expected**: the check's own entry expects exactly this failure (what is
  not a defect: a coverage limit of the engine's design);
- **NEW**: anything else, grouped by a title that does not depend on the draw
  (``defects.title_of``), so that one new problem met by five checks is one group.

A check whose exploration met known defects records them (``known_defects``:
once per defect per check, with a count and a minimized repro); each joins its
defect's group.  A coverage failure of a check whose examples known defects cut
short is the known defect's doing: it is said, and not NEW.

The run's verdict is "as expected" when nothing is NEW, no pinned expectation
is contradicted (an unexpected pass or skip), and every open defect's pinned
repro still reproduces; one that no longer does is **FIXED** (the file must say
so).  An open defect no check met is "not seen": informational only, never a
failure -- a fuzzing check that happens not to meet it simply passes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from conformance.results.defects import DefectTable, facts_of, load_table, title_of
from conformance.results.expectations import (
    BAD,
    check_facts,
    entry_for,
    expected,
    load_expectations,
    run_facts,
)


@dataclass
class Group:
    """One signature: a known defect, or one NEW title."""

    key: str  # the defect id, or the NEW title
    status: str  # "known" | "new"
    title: str
    kind: str
    category: str = "new"  # defect | limitation | new | regression
    checks: list[str] = field(default_factory=list)
    first_check: str | None = None
    first_repro: str | None = None
    first_message: str = ""
    first_steps: int | None = None
    examples: int = 0  # examples that met it (known defects met while exploring)
    upstream: str = ""

    def add(self, check: str, repro: str | None, message: str, steps: int | None, examples: int = 1) -> None:
        if check not in self.checks:
            self.checks.append(check)
        if self.first_check is None or (repro and not self.first_repro):
            self.first_check, self.first_repro, self.first_message, self.first_steps = check, repro, message, steps
        self.examples += examples


@dataclass
class Verdict:
    """A run triaged against an expectations file."""

    new: list[Group] = field(default_factory=list)
    known: list[Group] = field(default_factory=list)
    unexpected_failures: list[tuple[str, str]] = field(default_factory=list)  # (check, why): the NEW ones
    unexpected_passes: list[str] = field(default_factory=list)
    unexpected_skips: list[tuple[str, str]] = field(default_factory=list)  # (check, reason)
    expected_failures: list[tuple[str, str]] = field(default_factory=list)  # (check, kind): known or pinned
    skipped: list[tuple[str, str]] = field(default_factory=list)  # unlisted checks that were skipped
    not_seen: list[str] = field(default_factory=list)  # open defects no check met
    fixed: list[dict] = field(default_factory=list)  # pinned repros that no longer reproduce
    changed: list[dict] = field(default_factory=list)  # pinned repros that now fail otherwise (NEW)
    reproduces: list[str] = field(default_factory=list)
    not_replayed: list[dict] = field(default_factory=list)
    by_check: dict[str, str] = field(default_factory=dict)  # check -> "known D" | "expected" | "NEW"
    nothing_checked: bool = False

    @property
    def ok(self) -> bool:
        return not (self.unexpected_failures or self.unexpected_passes or self.unexpected_skips
                    or self.nothing_checked or self.fixed or self.changed)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _facts(result_dict: dict, c: dict) -> dict:
    if c.get("facts"):
        return c["facts"]
    failure = c.get("failure") or {}
    if failure.get("impl_config"):
        return facts_of(failure["impl_config"])
    return check_facts(run_facts(result_dict), c)["options"]


def judge(result_dict: dict, doc: dict, table: DefectTable | None = None) -> Verdict:
    """Triage ``result_dict`` (a results.json) against an expectations
    document (``doc``: its per-check entries; ``table``: its defects)."""
    table = table if table is not None else load_table(doc)
    pins = doc.get("checks", {})
    facts = run_facts(result_dict)
    verdict = Verdict()
    checks = result_dict.get("checks", [])
    verdict.nothing_checked = not any(c.get("status") != "skipped" for c in checks)
    groups: dict[str, Group] = {}

    def known_group(defect) -> Group:
        if defect.id not in groups:
            groups[defect.id] = Group(defect.id, "known", defect.title, "|".join(defect.kinds), defect.category,
                                      upstream=defect.upstream_text())
        return groups[defect.id]

    def new_group(kind: str, message: str, regressed=None) -> Group:
        title = title_of(kind, message) if regressed is None else \
            f"REGRESSION of {regressed.id} (fixed in {regressed.fixed_in}): {regressed.title}"
        if title not in groups:
            groups[title] = Group(title, "new", title, kind, "regression" if regressed is not None else "new")
        return groups[title]

    for c in checks:
        cid = c["id"]
        for met in c.get("known_defects") or []:
            defect = table.defects.get(met.get("defect"))
            if defect is not None:
                known_group(defect).add(cid, met.get("repro"), met.get("message") or "",
                                        len(met.get("operations") or []), int(met.get("count") or 1))
        want = expected(entry_for(pins, c), check_facts(facts, c))
        failure = c.get("failure") or {}
        if c["status"] == "skipped":
            target = verdict.unexpected_skips if want.listed else verdict.skipped
            target.append((cid, c.get("reason") or "no reason given"))
            continue
        if c["status"] not in BAD:
            if c["status"] == "passed" and want.status == "failed":
                verdict.unexpected_passes.append(cid)
            continue
        kind, message = failure.get("kind") or c["status"], failure.get("message") or ""
        match = table.classify(failure.get("kind"), message, _facts(result_dict, c))
        steps = len(failure.get("operations") or []) or None
        if match is not None and not match.regressed:
            if not any(m.get("defect") == match.defect.id for m in c.get("known_defects") or []):
                known_group(match.defect).add(cid, failure.get("repro"), message, steps)
            verdict.expected_failures.append((cid, kind))
            verdict.by_check[cid] = f"known {match.defect.id}"
            continue
        if want.matches(c):
            verdict.expected_failures.append((cid, kind))
            verdict.by_check[cid] = "expected"
            continue
        cut_short = [m["defect"] for m in c.get("known_defects") or [] if m.get("defect") in table.defects]
        if kind == "coverage" and cut_short:
            # the situation was not reached because known defects ended examples early: theirs, said
            verdict.expected_failures.append((cid, kind))
            verdict.by_check[cid] = f"known {cut_short[0]} (coverage: examples ended at it)"
            continue
        got = f"{kind}: {message[:300]}"
        why = got if want.status == "passed" else f"expected {want.describe()}, got {got}"
        verdict.unexpected_failures.append((cid, why))
        new_group(kind, message, match.defect if match is not None else None).add(cid, failure.get("repro"),
                                                                                   message, steps)
        verdict.by_check[cid] = "NEW"
    for rec in result_dict.get("defect_replays") or []:
        outcome = rec.get("outcome")
        if outcome == "fixed":
            verdict.fixed.append(rec)
        elif outcome == "changed":
            verdict.changed.append(rec)
            title = f"the pinned repro of {rec['defect']} now fails otherwise: {rec.get('kind')}"
            new_group(rec.get("kind") or "failure", title).add(f"(pinned repro of {rec['defect']})",
                                                               rec.get("repro"), rec.get("message") or "", None)
        elif outcome == "reproduces":
            verdict.reproduces.append(rec["defect"])
        else:
            verdict.not_replayed.append(rec)
    verdict.known = [g for g in groups.values() if g.status == "known"]
    verdict.new = [g for g in groups.values() if g.status == "new"]
    seen = {g.key for g in verdict.known} | {rec["defect"] for rec in verdict.fixed}
    verdict.not_seen = [d.id for d in table.open() if d.id not in seen]
    return verdict


def judge_file(result_dict: dict, path: str | Path) -> tuple[Verdict, dict]:
    doc, table = _loaded(path)
    return judge(result_dict, doc, table), doc


_LOADED: dict[tuple[str, int], tuple[dict, DefectTable]] = {}


def _loaded(path: str | Path) -> tuple[dict, DefectTable]:
    """The file, parsed and validated once per version of it (a run writes
    its reports after every check)."""
    path = Path(path)
    try:
        key = (str(path.resolve()), path.stat().st_mtime_ns)
    except OSError:
        key = (str(path), -1)
    if key not in _LOADED:
        doc = load_expectations(path)
        _LOADED[key] = (doc, load_table(doc, path))
    return _LOADED[key]


def judge_cached(result_dict: dict, path: str | Path) -> Verdict:
    return judge_file(result_dict, path)[0]


# Names of the old expectations API (conformance.results.compare re-exports them).
def judge_expectations(result_dict: dict, doc: dict) -> Verdict:
    return judge(result_dict, doc)


def compare_with_expectations(result_dict: dict, expectations_path: str | Path) -> tuple[list[str], list[str]]:
    """(unexpected failures, unexpected passes).  A check absent from the file
    is expected to pass unless a known defect explains its failure."""
    verdict, _ = judge_file(result_dict, expectations_path)
    return [cid for cid, _ in verdict.unexpected_failures], verdict.unexpected_passes


def format_verdict(verdict: Verdict, doc: dict, path, result_dict: dict) -> str:
    """The console's triage: NEW groups first, then the known defects (one line
    each, with the checks and the first repro), FIXED, the per-check pins."""
    lines = [f"expectations {doc.get('engine')} {doc.get('version')} ({path})"]
    if verdict.nothing_checked:
        lines.append("  NOTHING WAS CHECKED: every check was skipped (or none ran)")
    for g in verdict.new:
        lines.append(f"  NEW          {g.title} -- {len(g.checks)} check{'s' if len(g.checks) != 1 else ''}: "
                     f"{', '.join(g.checks[:6])}{' ...' if len(g.checks) > 6 else ''}"
                     + (f"; first repro: {g.first_repro}" if g.first_repro else ""))
    for cid, why in verdict.unexpected_failures:
        lines.append(f"  UNEXPECTED FAILURE {cid}: {why}")
    version = result_dict.get("implementation_version")
    mutant = result_dict.get("mutant")
    for rec in verdict.fixed:
        on = f"{version} with mutant {mutant}" if mutant else version
        todo = "the patch removes its cause" if mutant else f'update the file (status = "fixed in {version}")'
        lines.append(f"  FIXED: {rec['defect']} -- its pinned repro ({rec.get('operations')} operations, "
                     f"{rec.get('repro')}) no longer reproduces on {on}; {todo}")
    for rec in verdict.changed:
        lines.append(f"  CHANGED      {rec['defect']}: its pinned repro now fails otherwise ({rec.get('kind')}: "
                     f"{(rec.get('message') or '')[:200]})")
    by_id = {c["id"]: c for c in result_dict.get("checks", [])}
    for cid in verdict.unexpected_passes:
        entry = entry_for(doc.get("checks", {}), by_id[cid])
        lines.append(f"  unexpected pass    {cid} (expected to fail: {entry.get('reason', '')} "
                     f"{' '.join(entry.get('upstream', []))}); update the expectations file")
    for cid, reason in verdict.unexpected_skips:
        lines.append(f"  UNEXPECTED SKIP    {cid}: {reason} (the file expects a result)")
    for g in verdict.known:
        lines.append(f"  known {g.category:<10} {g.key} ({g.upstream}): {len(g.checks)} check"
                     f"{'s' if len(g.checks) != 1 else ''}, {g.examples} example{'s' if g.examples != 1 else ''}: "
                     f"{', '.join(g.checks[:6])}{' ...' if len(g.checks) > 6 else ''}"
                     + (f"; first repro: {g.first_repro}" if g.first_repro else ""))
    pins = doc.get("checks", {})
    for cid, kind in verdict.expected_failures:
        if verdict.by_check.get(cid, "").startswith("known"):
            continue
        entry = entry_for(pins, by_id[cid])
        lines.append(f"  expected failure   {cid} [{kind}] ({' '.join(entry.get('upstream', []))})")
    for cid, why in sorted((c, w) for c, w in verdict.by_check.items() if "coverage: examples ended" in w):
        lines.append(f"  coverage cut short {cid}: {why}")
    for did in verdict.not_seen:
        lines.append(f"  not seen           {did} (no check met it; its pinned repro decides whether it is fixed)")
    if verdict.reproduces:
        lines.append(f"  pinned repros reproduce: {', '.join(verdict.reproduces)}")
    for rec in verdict.not_replayed:
        lines.append(f"  not replayed       {rec['defect']}: {rec.get('note', '')}")
    for cid, reason in verdict.skipped:
        lines.append(f"  skipped            {cid}: {reason}")
    lines.append("as expected" if verdict.ok else "NOT as expected")
    return "\n".join(lines)


def format_expectations(result_dict: dict, expectations_path: str | Path) -> tuple[str, bool]:
    verdict, doc = judge_file(result_dict, expectations_path)
    return format_verdict(verdict, doc, expectations_path, result_dict), verdict.ok
