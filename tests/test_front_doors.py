"""One run behind every front door: the same check and configuration variant
draws the same examples (the same counts, operations and coverage, the same
verdict) from the CLI, a ``--workers`` process, the pytest plugin and
``machine_test``.  The variant is the second of its check's matrix, the one
``machine_test`` used to seed at another index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli.main import main as cli

ROOT = Path(__file__).resolve().parent.parent
VARIANT = "mid-block-hits[interval=8]"
MODULE = """
from conformance.adapters.reference import ReferenceCache


class MatrixCache(ReferenceCache):
    name = "matrix-cache"
    config_matrix = {"mid-block-hits": ({}, {"interval": 8})}
"""
EXAMPLES, STEPS = "4", "5"


def _same(c: dict) -> tuple:
    failure = c.get("failure") or {}
    return (c["id"], c["status"], c["examples"], c["test_cases"], c["operations"], c["coverage"],
            failure.get("kind"), failure.get("message"))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("project")
    (d / "matrixcache.py").write_text(MODULE)
    return d


def _cli(project: Path, out: Path, *extra: str) -> dict:
    cwd = os.getcwd()
    os.chdir(project)  # the CLI imports module:Class from the current directory
    try:
        cli(["run", "--impl", "matrixcache:MatrixCache", "--check", "mid-block-hits", "--examples", EXAMPLES,
             "--steps", STEPS, "--report-dir", str(out), *extra])
    finally:
        os.chdir(cwd)
    doc = json.loads((out / "results.json").read_text())
    return next(c for c in doc["checks"] if c["id"] == VARIANT)


def test_the_same_variant_draws_the_same_examples_from_every_front_door(project, tmp_path):
    serial = _cli(project, tmp_path / "cli")
    parallel = _cli(project, tmp_path / "workers", "--workers", "2")  # each check in a spawned process

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + str(project)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conformance.pytest_plugin", "-p", "no:cacheprovider",
                           "-q", "--hybrid-impl", "matrixcache:MatrixCache", "--hybrid-check", "mid-block-hits",
                           "--hybrid-examples", EXAMPLES, "--hybrid-steps", STEPS,
                           "--hybrid-report-dir", str(tmp_path / "plugin")],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout + proc.stderr
    plugin = next(c for c in json.loads((tmp_path / "plugin" / "results.json").read_text())["checks"]
                  if c["id"] == VARIANT)

    sys.path.insert(0, str(project))
    try:
        from matrixcache import MatrixCache  # type: ignore[import-not-found]

        from conformance.testing import machine_test

        test = machine_test(MatrixCache, check=VARIANT, examples=int(EXAMPLES), steps=int(STEPS))
        try:
            test()
        except AssertionError:
            pass  # a coverage failure is a verdict like any other: it must be the same one
        single = test.last_result.to_dict()
    finally:
        sys.path.remove(str(project))

    assert _same(serial) == _same(parallel) == _same(plugin) == _same(single)
    assert serial["examples"] == int(EXAMPLES)  # examples as --examples asked, not state machines built


def test_the_python_api_of_docs_reports_md(tmp_path, monkeypatch):
    """The snippet docs/reports.md shows runs as written (the Run is frozen; the plan says the seeds)."""
    import dataclasses
    import re

    monkeypatch.chdir(tmp_path)  # the default report directory goes under ./reports
    text = (ROOT / "docs" / "reports.md").read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1).replace("examples=10", "examples=2")
    ns: dict = {}
    exec(compile(code, "docs/reports.md", "exec"), ns)
    run, result = ns["run"], ns["result"]
    assert [(p.id, p.seed_index) for p in run.checks] == [("mid-block-hits", 0)]
    assert result.checks[0].examples == 2 and (run.report_dir / "results.json").exists()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 3


def test_one_seed_function_and_the_seeds_it_gives():
    """The values every run before the prepared Run used (results stay comparable across the change)."""
    from conformance.suite.checks import CATALOGUE, PROFILES
    from conformance.suite.seeds import check_seed, seed_index

    assert seed_index(CATALOGUE, "mid-block-hits[prefix_match_unit=1]") == seed_index(CATALOGUE, "mid-block-hits") == 0
    assert seed_index(CATALOGUE, "mixed") == len(PROFILES["quick"].checks)  # after the quick profile's checks
    assert check_seed(1, 6) == 1006 and check_seed(2, 8, pairing=1, pairings=2) == (2 * 1000 + 8) * 2 + 1
    for profile in PROFILES.values():  # every profile lists a prefix of the catalogue: index = position
        assert profile.checks == CATALOGUE[:len(profile.checks)]
