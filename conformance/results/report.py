"""Writes what a run produced: results.json, junit.xml, index.html and repro files.

Every write goes to a temporary file first and is renamed into place, so a
run killed at any moment leaves valid files for what had finished."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.results.files import atomic_write, strict_json
from conformance.results.html import replay_command, write_index
from conformance.results.records import CheckResult, RunResult

REPRO_SCHEMA = "hybrid-cache-conformance/repro"
REPRO_VERSION = 2  # docs/repro-format.md; conformance.results.repro reads it


def write_all(out: Path, result: RunResult) -> None:
    atomic_write(out / "results.json", strict_json(result.to_dict(), indent=2, default=str) + "\n")
    atomic_write(out / "junit.xml", junit_xml(result))

    write_index(out, [result.to_dict()])


def junit_xml(result: RunResult) -> str:
    summary = result.to_dict()["summary"]
    suite = ET.Element("testsuite", name=f"hybrid-cache-conformance[{result.implementation}]",
                       tests=str(len(result.checks)), failures=str(summary["failed"]), errors=str(summary["error"]),
                       skipped=str(summary["skipped"]),
                       time=f"{sum(c.seconds for c in result.checks):.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in (("implementation", result.implementation), ("version", result.implementation_version),
                       ("seed", result.seed), ("profile", result.profile), ("mutant", result.mutant or "")):
        ET.SubElement(props, "property", name=key, value=str(value))
    for c in result.checks:
        case = ET.SubElement(suite, "testcase", classname=f"conformance.{c.family}", name=c.id, time=f"{c.seconds:.3f}")
        if c.status in ("failed", "error") and c.failure is not None:
            el = ET.SubElement(case, "failure" if c.status == "failed" else "error",
                               message=c.failure.message[:500], type=c.failure.kind)
            el.text = _witness(c, result.impl_spec)
        elif c.status == "skipped":
            ET.SubElement(case, "skipped", message=c.reason)
    return ET.tostring(suite, encoding="unicode") + "\n"


def _witness(c: CheckResult, impl_spec: str | None = None) -> str:
    lines = [c.failure.message, "", f"minimized sequence ({len(c.failure.steps)} operations):"]
    lines += [f"  {i + 1}. {json.dumps(s)}" for i, s in enumerate(c.failure.steps)]
    if c.failure.repro:
        lines += ["", f"replay: {replay_command(c.failure.repro, impl_spec)}"]
    return "\n".join(lines)


def repro_document(result: RunResult, check: CheckResult, impl_config: dict) -> dict:
    mutant_part = f" with mutant {result.mutant}" if result.mutant else ""
    return {
        "schema": REPRO_SCHEMA,
        "schema_version": REPRO_VERSION,
        "title": f"{check.id}: {check.failure.kind} failure on {result.implementation}{mutant_part}",
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
        "failure": {"kind": check.failure.kind, "message": check.failure.message},
        "steps": check.failure.steps,
        # informational only (replay recomputes them): the last plans and verdicts
        "events": check.failure.events,
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


def write_failure_repro(out: Path, result: RunResult, check: CheckResult, impl_config: dict) -> Path | None:
    if check.failure is None or not check.failure.steps:
        return None
    repro_dir = out / "repros"
    repro_dir.mkdir(exist_ok=True)
    name = f"{check.id}" + (f"--{result.mutant}" if result.mutant else "") + ".json"
    path = repro_dir / name
    doc = repro_document(result, check, impl_config)
    atomic_write(path, strict_json(doc, indent=2, default=str) + "\n")
    check.failure.repro = str(path)
    return path
