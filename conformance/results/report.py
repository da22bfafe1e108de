"""Writes what a run produced: results.json, junit.xml, index.html and repro files.

:class:`ReportDir` is the one writer every run goes through (the CLI, the
pytest plugin, the engine-level run, a merge of shards): it holds the
directory's lock, writes a failing check's repro, then the three reports,
after every check.  Every write goes to a temporary file first and is renamed
into place, so a run killed at any moment leaves valid files for what had
finished."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.errors import UsageError
from conformance.results.files import atomic_write, strict_json
from conformance.results.html import replay_command, write_index
from conformance.results.records import CheckResult, Failure, RunResult

REPRO_SCHEMA = "hybrid-cache-conformance/repro"
REPRO_VERSION = 3  # docs/repro-format.md; conformance.results.repro reads it (and versions 1 and 2)
LOCK = ".lock"
NOT_RUN = "not run: interrupted"
NOT_RUN_CRASHED = "not run: the run crashed"
NOT_RUN_PENDING = "not run: pending"


class ReportDir:
    """A run's report directory, held for the run: a second run into the same
    directory at the same time is refused (its reports would overwrite this
    one's), and a directory that cannot be written is a usage error before any
    check runs.  The lock file holds the owner's pid; a lock left by a process
    that no longer exists (a SIGKILL) is taken over."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._locked = False

    def open(self) -> ReportDir:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
            clear_previous_run(self.path)  # held now: only this run writes here from here on
        except OSError as exc:
            raise UsageError(f"--report-dir {self.path}: cannot write there: {exc.strerror or exc}") from None
        return self

    def _lock(self) -> None:
        lock = self.path / LOCK
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _owner(lock)
                if owner is not None and owner != os.getpid() and _alive(owner):
                    raise UsageError(f"--report-dir {self.path}: another run (pid {owner}) is writing its reports "
                                     f"there; use another directory, or wait for it") from None
                lock.unlink(missing_ok=True)  # left by a run that is gone: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self._locked = True
            return

    def close(self) -> None:
        if self._locked:
            (self.path / LOCK).unlink(missing_ok=True)
            self._locked = False

    def __enter__(self) -> ReportDir:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def check_finished(self, result: RunResult, check: CheckResult) -> None:
        """After each check: its repro (if it failed), then every report, so
        that a run killed later keeps this check."""
        if check.failure is not None:  # the configuration it failed under, recorded by the check
            write_failure_repro(self.path, result, check, check.failure.impl_config or {})
        self.write(result)

    def write(self, result: RunResult) -> None:
        write_all(self.path, result)

    def finish(self, result: RunResult) -> None:
        """The run ended (or was interrupted): the plot, then every report, then the lock goes."""
        from conformance.results.plots import write_run_plot

        why = write_run_plot(self.path, result)
        if why:
            result.metrics["plots_missing"] = why
        self.write(result)
        self.close()


# What a run writes at the top of its report directory (each also as ``<name>.tmp`` while written).
RUN_FILES = ("results.json", "junit.xml", "index.html", "cache-metrics.png")


def clear_previous_run(out: Path) -> list[Path]:
    """Remove what an earlier run left in ``out``, so that the directory holds
    only the run about to write there: its results, JUnit, HTML and plot, and
    its repro files (``repros/*.json``, ``repros/known/<defect>/*.json``),
    each recognized as the suite's by name and, for a repro, by its schema.
    A repro of the earlier run that stayed would sit beside this run's
    results as if this run had found it (and the HTML and a reader of the
    folder would take it for one).  Anything else (a user's notes, another
    tool's files, ``economics --report-dir`` output) stays.  Returns what went."""
    gone = []
    for name in RUN_FILES:
        for path in (out / name, out / (name + ".tmp")):
            if path.is_file() and not path.is_symlink():
                path.unlink()
                gone.append(path)
    repros = out / "repros"
    if repros.is_dir() and not repros.is_symlink():
        folders = [repros, *(sorted(p for p in (repros / "known").glob("*") if p.is_dir() and not p.is_symlink())
                             if (repros / "known").is_dir() and not (repros / "known").is_symlink() else [])]
        for folder in folders:
            for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.json.tmp")):
                if path.is_file() and not path.is_symlink() and _is_repro(path):
                    path.unlink()
                    gone.append(path)
        for folder in reversed([*folders[:1], repros / "known", *folders[1:]]):
            try:
                folder.rmdir()  # only when nothing else is left in it
            except OSError:
                pass
    return gone


def _is_repro(path: Path) -> bool:
    """Whether ``path`` is a repro file this suite wrote (cache or engine level), by its schema."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    # written by json.dumps(doc, indent=2): the schema is the first key, on the second line
    return b'"schema": "hybrid-cache-conformance/' in head


def _owner(lock: Path) -> int | None:
    try:
        return int(lock.read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def results_document(result: RunResult) -> dict:
    """results.json: the run, its triage against the engine version's known
    defects and expectations when it has a file (conformance.results.triage),
    and its verdict (conformance.results.verdict): the one a finished run
    carries, else judged now (a run still running reads incomplete, its
    planned checks "not run: pending")."""
    from conformance.results.verdict import judge_run

    doc = result.to_dict()
    verdict = result.verdict or judge_run(doc)
    if result.expectations:
        from conformance.results.triage import judge_cached

        doc["triage"] = judge_cached(doc, result.expectations["path"]).to_dict()
        doc["triage"]["ok"] = verdict.ok  # "as expected" only for a complete run
    doc["verdict"] = verdict.to_dict()
    return doc


def write_all(out: Path, result: RunResult) -> None:
    doc = results_document(result)
    atomic_write(out / "results.json", strict_json(doc, indent=2, default=str) + "\n")
    atomic_write(out / "junit.xml", junit_xml(result, doc))

    write_index(out, [doc])


def junit_xml(result: RunResult, doc: dict | None = None) -> str:
    """One ``<testcase>`` per planned check, rendering the run's verdict
    (``doc``: results.json as :func:`results_document` makes it).  A failure
    that is a known defect (or a failure the file expects) is a
    ``<skipped type="known-defect">`` (``"expected-failure"``) naming it, as
    pytest writes an xfail, so that a CI reading JUnit sees red exactly when
    the verdict is red; an unexpected pass or skip is a failure; each open
    defect's pinned repro is a testcase of its own (a failure when it no
    longer reproduces: FIXED).  A planned check without a result is an error
    ``not run: <why>`` (pending, interrupted, the run crashed, its shard
    missing...), and an incomplete run that no such case shows (nothing
    checked, a run that never finished) gets a ``run-verdict`` error of its
    own: a CI reading JUnit never sees an incomplete run as a pass."""
    from conformance.results.records import RunVerdict

    doc = doc if doc is not None else results_document(result)
    verdict = RunVerdict.from_dict(doc["verdict"])
    judged = verdict.expectations is not None
    suite = ET.Element("testsuite", name=f"hybrid-cache-conformance[{result.implementation}]",
                       time=f"{sum(c.seconds for c in result.checks):.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in (("implementation", result.implementation), ("version", result.implementation_version),
                       ("seed", result.seed), ("profile", result.profile), ("mutant", result.mutant or ""),
                       ("interrupted", str(result.interrupted).lower()), ("crashed", result.crashed),
                       ("not_run", len(result.not_run)), ("verdict", verdict.status),
                       ("verdict_line", verdict.headline())):
        ET.SubElement(props, "property", name=key, value=str(value))
    for c in result.checks:
        case = ET.SubElement(suite, "testcase", classname=f"conformance.{c.family}", name=c.id, time=f"{c.seconds:.3f}")
        cv = verdict.check(c.id)
        status = cv.status if cv is not None else "new"
        if status in ("known", "expected") and c.failure is not None:
            known = status == "known"
            label = f"known {', '.join(cv.defects)}" if known and cv is not None else "expected failure"
            el = ET.SubElement(case, "skipped", type="known-defect" if known else "expected-failure",
                               message=f"{label}: " + c.failure.message[:400])
            el.text = _witness(c, result.impl_spec)
        elif c.status in ("failed", "error") and c.failure is not None:
            el = ET.SubElement(case, "failure" if c.status == "failed" else "error",
                               message=(("NEW: " if judged else "") + c.failure.message)[:500], type=c.failure.kind)
            el.text = _witness(c, result.impl_spec)
        elif status == "unexpected-skip":
            ET.SubElement(case, "failure", type="unexpected-skip",
                          message=f"skipped ({c.reason}), but the expectations file expects a result")
        elif c.status == "skipped":
            ET.SubElement(case, "skipped", message=c.reason)
        elif status == "unexpected-pass":
            ET.SubElement(case, "failure", type="unexpected-pass",
                          message="passed, but the expectations file expects a failure: update the file")
        if c.known_defects:  # met while exploring (the check went on past each)
            met_props = ET.SubElement(case, "properties")
            for met in c.known_defects:
                ET.SubElement(met_props, "property", name=f"known-defect:{met['defect']}", value=str(met["count"]))
    for rec in result.defect_replays:
        case = ET.SubElement(suite, "testcase", classname="conformance.known-defects",
                             name=f"pinned-repro[{rec['defect']}]", time="0")
        if rec["outcome"] in ("fixed", "changed"):
            what = ("FIXED: the pinned repro no longer reproduces; mark the defect fixed in the expectations file"
                    if rec["outcome"] == "fixed" else f"the pinned repro now fails otherwise: {rec.get('kind')}: "
                                                      f"{(rec.get('message') or '')[:300]}")
            ET.SubElement(case, "failure", type=rec["outcome"], message=what).text = str(rec.get("repro"))
        elif rec["outcome"] != "reproduces":
            ET.SubElement(case, "skipped", message=rec.get("note") or rec["outcome"])
    not_run = [cv for cv in verdict.checks if cv.status == "not-run"]
    if result.interrupted or not_run:
        why = f"the run crashed ({result.crashed})" if result.crashed else \
            "the run was interrupted" if result.interrupted else "the run has not finished"
        ET.SubElement(suite, "system-err").text = \
            f"{why}: {len(result.checks)} checks finished, {len(not_run)} did not run"
    for cv in not_run:
        case = ET.SubElement(suite, "testcase", classname="conformance.not-run", name=cv.id, time="0.000")
        kind = "crashed" if cv.why == "the run crashed" else "interrupted" if cv.why == "interrupted" else "not-run"
        ET.SubElement(case, "error", message=f"not run: {cv.why}", type=kind).text = \
            f"{cv.id} was planned but did not run: {cv.why}"
    if verdict.status == "incomplete" and not not_run:
        case = ET.SubElement(suite, "testcase", classname="conformance.verdict", name="run-verdict", time="0.000")
        ET.SubElement(case, "error", message=verdict.headline()[:500], type="incomplete").text = \
            "\n".join(verdict.incomplete)
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for attr, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
        suite.set(attr, str(sum(c.find(tag) is not None for c in cases)))
    triage = doc.get("triage")
    if triage:
        for g in triage.get("known", []) + triage.get("new", []):
            ET.SubElement(props, "property", name=f"triage:{g['status']}:{g['key']}",
                          value=f"{len(g['checks'])} checks; first repro {g.get('first_repro') or '-'}")
    return ET.tostring(suite, encoding="unicode") + "\n"


def _witness(c: CheckResult, impl_spec: str | None = None) -> str:
    f = c.failure
    assert f is not None
    lines = [f.message, "", f"minimized sequence ({len(f.operations)} operations):"]
    lines += [f"  {i + 1}. {json.dumps(s)}" for i, s in enumerate(f.operations)]
    if f.repro:
        lines += ["", f"replay: {replay_command(f.repro, impl_spec)}"]
    return "\n".join(lines)


def repro_document(result: RunResult, check: CheckResult, impl_config: dict) -> dict:
    failure = check.failure
    assert failure is not None, "a repro is written for a failed check"
    mutant_part = f" with mutant {result.mutant}" if result.mutant else ""
    return {
        "schema": REPRO_SCHEMA,
        "schema_version": REPRO_VERSION,
        "title": f"{check.id}: {failure.kind} failure on {result.implementation}{mutant_part}",
        "upstream": [],
        "created": result.started,
        "harness": _harness_version(),
        "implementation": result.implementation,
        "implementation_version": result.implementation_version,
        "impl": result.impl_spec,
        "seed": result.seed,
        "profile": result.profile,
        "check": check.id,
        "family": check.family,
        "impl_config": impl_config,
        "model": result.model,
        "mutant": result.mutant,
        "faults": result.fault_names,
        "failure": {"kind": failure.kind, "message": failure.message},
        # what a known defect's conditions are judged on, and the defect this failure is (if known)
        "facts": check.facts,
        "defect": failure.defect,
        "operations": failure.operations,
        # informational only (replay recomputes them): the last plans and verdicts
        "events": failure.events,
    }


def _harness_version() -> dict:
    """The harness commit, so that a repro names the oracle it was judged by."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"name": "hybrid-cache-conformance", "commit": commit}


def write_known_repros(out: Path, result: RunResult, check: CheckResult, impl_config: dict) -> None:
    """``repros/known/<defect>/<check>[--<mutant>].json``: each known defect the
    check met, minimized; grouped by defect, as the triage groups them."""
    for met in check.known_defects:
        if not met.get("operations"):
            continue
        folder = out / "repros" / "known" / met["defect"]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / (f"{check.id}" + (f"--{result.mutant}" if result.mutant else "") + ".json")
        stand_in = CheckResult(id=check.id, family=check.family, status="failed", facts=check.facts,
                               failure=Failure(kind=met["kind"], message=met["message"], operations=met["operations"],
                                               events=met.get("events") or [], defect=met["defect"]))
        doc = repro_document(result, stand_in, impl_config)
        doc["title"] = f"{check.id}: known defect {met['defect']} ({met['title']}) on {result.implementation}"
        atomic_write(path, strict_json(doc, indent=2, default=str) + "\n")
        met["repro"] = str(path)
        if check.failure is not None and check.failure.defect == met["defect"] \
                and check.failure.operations == met["operations"]:
            check.failure.repro = str(path)


def write_failure_repro(out: Path, result: RunResult, check: CheckResult, impl_config: dict) -> Path | None:
    write_known_repros(out, result, check, impl_config)
    if check.failure is None or not check.failure.operations:
        return None
    if check.failure.repro:  # the check's failure is a known defect, written under repros/known/
        return Path(check.failure.repro)
    repro_dir = out / "repros"
    repro_dir.mkdir(exist_ok=True)
    name = f"{check.id}" + (f"--{result.mutant}" if result.mutant else "") + ".json"
    path = repro_dir / name
    doc = repro_document(result, check, impl_config)
    atomic_write(path, strict_json(doc, indent=2, default=str) + "\n")
    check.failure.repro = str(path)
    return path
