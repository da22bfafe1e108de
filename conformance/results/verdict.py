"""The run's verdict, decided once: :func:`judge_run` turns a results
document (results.json, or a run's result as it stands) into a
:class:`~conformance.results.records.RunVerdict`, the one value every door
renders (the CLI's exit status and last line, the pytest plugin's items,
``machine_test``, JUnit, HTML, ``matrix``, ``compare``, a merge of shards).

Two things decide it:

- **triage** (``conformance.results.triage.judge``): each failure matched
  against the engine version's expectations file, known defect, expected or
  NEW, and each open defect's pinned repro replayed (FIXED when it no longer
  reproduces).  Without a file, the raw verdict: every failure is NEW (the
  result's ``metrics.expectations.note`` says so);
- **completeness**: a run that did not check what it planned is never green:
  checks not run (still pending, after an interruption, a crash, a worker or
  the run's own process that died, a missing shard), nothing checked at all,
  or a check the file expects a result of that was skipped.

Statuses (``records.RUN_VERDICTS``), by precedence: ``new`` > ``incomplete``
> ``fixed`` > ``known`` > ``expected`` > ``passed``; the last three are green.
A NEW failure in an interrupted run reads ``new`` and lists the run as
incomplete too (``incomplete`` is never empty for it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conformance.results.records import CheckVerdict, PinnedVerdict, RunResult, RunVerdict
from conformance.results.triage import Verdict, judge, judge_cached


def judge_run(result: RunResult | dict, expectations: str | Path | None = None) -> RunVerdict:
    """The verdict of ``result`` (a RunResult, or results.json as a dict) against
    ``expectations`` (default: the file the run recorded, if any)."""
    doc = result.to_dict() if isinstance(result, RunResult) else result
    path = expectations or ((doc.get("expectations") or {}).get("path"))
    missing = ""
    if path and not Path(path).is_file():  # a results.json from another machine names a file not here
        missing, path = f"the expectations file {path} is not here: the raw verdict (every failure counts as NEW)", None
    if path:
        triage = judge_cached(doc, path)
    else:
        triage = judge(doc, {})  # the raw verdict: no known defect, no expectation; every failure NEW
    verdict = _verdict(doc, triage, str(path) if path else None)
    return replace(verdict, note=missing) if missing else verdict


def _verdict(doc: dict, triage: Verdict, path: str | None) -> RunVerdict:
    checks = doc.get("checks") or []
    unexpected_passes = set(triage.unexpected_passes)
    unexpected_skips = dict(triage.unexpected_skips)
    out: list[CheckVerdict] = []
    for c in checks:
        cid = c["id"]
        failure = c.get("failure") or {}
        first = ((failure.get("message") or "").splitlines() or [""])[0][:300]
        met = tuple(m["defect"] for m in c.get("known_defects") or [] if m.get("defect"))
        label = triage.by_check.get(cid, "")
        if c.get("status") == "skipped":
            status = "unexpected-skip" if cid in unexpected_skips else "skipped"
            out.append(CheckVerdict(cid, status, why=c.get("reason") or "no reason given"))
        elif c.get("status") == "passed":
            if cid in unexpected_passes:
                out.append(CheckVerdict(cid, "unexpected-pass",
                                        why="passed, but the expectations file expects a failure: update the file"))
            else:
                out.append(CheckVerdict(cid, "passed"))
        elif label.startswith("known"):
            defect = label.split()[1]
            ids = (defect,) + tuple(d for d in met if d != defect)
            out.append(CheckVerdict(cid, "known", ids, f"{label}: {failure.get('kind')}: {first}"))
        elif label == "expected":
            out.append(CheckVerdict(cid, "expected", met, f"expected {failure.get('kind')}: {first}"))
        else:
            out.append(CheckVerdict(cid, "new", met, f"{failure.get('kind') or c.get('status')}: {first}"))
    reasons = dict(doc.get("not_run_reasons") or {})
    for cid in doc.get("not_run") or []:
        out.append(CheckVerdict(cid, "not-run", why=reasons.get(cid) or _state(doc)))
    pinned = tuple(PinnedVerdict(r.get("defect", "?"), r.get("outcome", "?"), str(r.get("repro") or ""),
                                 r.get("note") or (f"{r.get('kind')}: {(r.get('message') or '')[:300]}"
                                                   if r.get("outcome") == "changed" else ""))
                   for r in doc.get("defect_replays") or [])
    incomplete = _incomplete(doc, out, triage)
    new = tuple(g.title for g in triage.new)
    known = tuple(g.key for g in triage.known)
    fixed = tuple([r["defect"] for r in triage.fixed] + [f"{cid} (passed)" for cid in triage.unexpected_passes])
    if new or any(c.status == "new" for c in out):
        status = "new"
    elif incomplete:
        status = "incomplete"
    elif fixed:
        status = "fixed"
    elif known:
        status = "known"
    elif any(c.status == "expected" for c in out):
        status = "expected"
    else:
        status = "passed"
    note = "" if path else "no expectations file: the raw verdict (every failure counts as NEW)"
    return RunVerdict(status=status, checks=tuple(out), pinned=pinned, incomplete=incomplete, new=new, known=known,
                      fixed=fixed, expectations=path, note=note)


def _state(doc: dict) -> str:
    if doc.get("crashed"):
        return "the run crashed"
    if doc.get("interrupted"):
        return "interrupted"
    if _unfinished(doc):
        return "pending"
    return "the run ended before it"


def _unfinished(doc: dict) -> bool:
    """results.json always has ``finished``; null until the run ends (a run
    killed, or still running).  A hand-made document without the key is not judged on it."""
    return "finished" in doc and not doc["finished"]


def _incomplete(doc: dict, checks: list[CheckVerdict], triage: Verdict) -> tuple[str, ...]:
    out = []
    if doc.get("crashed"):
        out.append(f"the run crashed ({doc['crashed']})")
    elif doc.get("interrupted"):
        out.append("the run was interrupted")
    elif _unfinished(doc):
        out.append("the run did not finish (it is still running, or its process was killed)")
    missing = [c for c in checks if c.status == "not-run"]
    if missing:
        by_why: dict[str, list[str]] = {}
        for c in missing:
            by_why.setdefault(c.why, []).append(c.id)
        for why, ids in by_why.items():
            out.append(f"{len(ids)} planned check{'s' if len(ids) != 1 else ''} not run ({why}): "
                       f"{', '.join(ids[:4])}{' ...' if len(ids) > 4 else ''}")
    if not any(c.status not in ("skipped", "unexpected-skip", "not-run") for c in checks):
        out.append("nothing was checked (every check was skipped, or none ran)")
    for c in checks:
        if c.status == "unexpected-skip":
            out.append(f"{c.id} was skipped, but the expectations file expects a result ({c.why})")
    return tuple(out)


def verdict_of(doc: dict) -> RunVerdict:
    """The verdict a results.json records, or judged now when it records none
    (a file from an older harness)."""
    recorded = doc.get("verdict")
    if isinstance(recorded, dict) and recorded.get("status"):
        return RunVerdict.from_dict(recorded)
    return judge_run(doc)
