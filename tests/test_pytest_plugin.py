"""The pytest plugin inside "an engine's own test suite": a throwaway project
run in a subprocess, with the plugin loaded by ``-p`` (as without the
entry point), one pytest test per check, and the CLI's report files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent



def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conformance.pytest_plugin", "-p", "no:cacheprovider",
                           # minimized by replay (seconds), not by Hypothesis's shrinker (minutes)
                           "--hybrid-shrink", "ops", "-q", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_one_pytest_test_per_check_with_repro_files(tmp_path):
    (tmp_path / "test_engine.py").write_text("def test_engine_own_test():\n    pass\n")
    report = tmp_path / "rep"
    proc = _pytest(tmp_path, "--hybrid-impl", "reference", "--hybrid-mutant", "late-snapshot",
                   "--hybrid-check", "mid-block-hits", "--hybrid-check", "snapshot-reuse",
                   "--hybrid-examples", "20", "--hybrid-steps", "6", "--hybrid-report-dir", str(report),
                   "--junitxml", str(tmp_path / "pytest-junit.xml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 failed, 2 passed" in proc.stdout  # the two checks, the adapter's own test, the run's verdict
    assert "hybrid-conformance[mid-block-hits]" in proc.stdout
    assert "replay: hybrid-conformance replay" in proc.stdout
    assert (report / "repros" / "mid-block-hits--late-snapshot.json").exists()
    results = json.loads((report / "results.json").read_text())
    assert [c["id"] for c in results["checks"]] == ["mid-block-hits", "snapshot-reuse"]
    assert results["finished"] and results["mutant"] == "late-snapshot"
    cases = ET.parse(report / "junit.xml").getroot().findall("testcase")
    assert len(cases) == 2
    # pytest's own junit names the conformance tests too
    names = [c.get("name") for c in ET.parse(tmp_path / "pytest-junit.xml").getroot().iter("testcase")]
    assert "hybrid-conformance[snapshot-reuse]" in names


def test_the_fixture_for_adapter_authors(tmp_path):
    (tmp_path / "test_adapter.py").write_text(
        "import pytest\n"
        "from conformance.adapters.reference import ReferenceCache\n"
        "from conformance.pytest_plugin import check_ids\n\n"
        "class MyCache(ReferenceCache):\n"
        "    name = 'my-cache'\n\n"
        "@pytest.mark.parametrize('check', ['mid-block-hits'])\n"
        "def test_my_cache(hybrid_conformance, check):\n"
        "    assert check in check_ids('quick')\n"
        "    hybrid_conformance.check(MyCache, check)\n")
    report = tmp_path / "rep"
    # A seeded bug in MyCache: the fixture fails the adapter's test with the witness and writes the repro.
    proc = _pytest(tmp_path, "--hybrid-mutant", "hit-off-by-one", "--hybrid-examples", "20", "--hybrid-steps", "6",
                   "--hybrid-report-dir", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_my_cache[mid-block-hits]" in proc.stdout and "replay: hybrid-conformance replay" in proc.stdout
    results = json.loads((report / "results.json").read_text())
    assert results["implementation"] == "my-cache" and results["checks"][0]["status"] == "failed"
    repro = json.loads((report / "repros" / "mid-block-hits--hit-off-by-one.json").read_text())
    assert repro["impl"] == "test_adapter:MyCache"  # replaying it needs --impl (never imported from the file)


def test_without_hybrid_impl_the_plugin_adds_nothing(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    proc = _pytest(tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr


def test_skips_are_pytest_skips_and_the_adapter_imports_from_the_current_directory(tmp_path):
    """The README's NoCache, in a module of the current directory, run by the
    ``pytest`` script (whose sys.path does not hold the current directory): a
    check it cannot run is a pytest skip with its reason, never a pass, and a
    situation it never reaches fails on coverage."""
    import re

    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class NoCache" in b)
    (tmp_path / "nocache.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = Path(sys.executable).parent / "pytest"
    argv = [str(script) if script.exists() else sys.executable, *([] if script.exists() else ["-m", "pytest"])]
    proc = subprocess.run([*argv, "-p", "conformance.pytest_plugin", "-p", "no:cacheprovider", "-rs", "-q",
                           "--hybrid-impl", "nocache:NoCache", "--hybrid-check", "tier-reuse",
                           "--hybrid-check", "mid-block-hits", "--hybrid-examples", "3", "--hybrid-steps", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed, 1 skipped" in out and "no second tier" in out, out  # the run's verdict passes
    assert "(coverage)" in out and re.search(r"mid_block_hits\b.* stayed at 0", out), out
    # a module that is not there: a usage error with a hint
    proc = subprocess.run([*argv, "-p", "conformance.pytest_plugin", "-p", "no:cacheprovider", "-q",
                           "--hybrid-impl", "nosuchmodule:X"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "run from the directory that holds nosuchmodule" in proc.stdout + proc.stderr


def test_one_test_per_variant_of_the_configuration_matrix(tmp_path):
    """An implementation that declares a configuration matrix gets one pytest
    test per variant, as the CLI runs them, each with the check's seed;
    ``--hybrid-no-matrix`` runs the check once; the fixture form lists the
    variants through ``check_ids(profile, impl)``."""
    (tmp_path / "matrixcache.py").write_text(
        "from conformance.adapters.reference import ReferenceCache\n\n"
        "class MatrixCache(ReferenceCache):\n"
        "    name = 'matrix-cache'\n"
        "    config_matrix = {'mid-block-hits': ({}, {'interval': 8})}\n")
    (tmp_path / "test_fixture_form.py").write_text(
        "from conformance.pytest_plugin import check_ids\n"
        "from matrixcache import MatrixCache\n\n"
        "def test_variants_listed():\n"
        "    ids = check_ids('quick', MatrixCache)\n"
        "    assert ids[:2] == ['mid-block-hits', 'mid-block-hits[interval=8]']\n"
        "    assert check_ids('quick', MatrixCache, {'interval': 0})[:2] == ['mid-block-hits', 'multi-turn-replay']\n")
    report = tmp_path / "rep"
    common = ("--hybrid-impl", "matrixcache:MatrixCache", "--hybrid-check", "mid-block-hits",
              "--hybrid-examples", "3", "--hybrid-steps", "4")
    proc = _pytest(tmp_path, *common, "--hybrid-report-dir", str(report))
    out = proc.stdout + proc.stderr
    # the abort-copy rule builds a mid-block hit whole in one draw: three examples reach every variant's coverage
    assert "4 passed" in out, out  # two variants, the fixture form's test, the run's verdict
    results = json.loads((report / "results.json").read_text())
    assert [c["id"] for c in results["checks"]] == ["mid-block-hits", "mid-block-hits[interval=8]"]
    proc = _pytest(tmp_path, *common, "--hybrid-no-matrix", "--hybrid-option", "interval=0", "test_fixture_form.py",
                   "--hybrid-report-dir", str(tmp_path / "rep2"))
    out = proc.stdout + proc.stderr
    assert "3 passed" in out and "interval=8]" not in out, out
    results = json.loads((tmp_path / "rep2" / "results.json").read_text())
    assert [c["id"] for c in results["checks"]] == ["mid-block-hits"]
    assert results["impl_config"]["options"] == {"interval": 0}


def test_a_check_the_harness_crashes_in_never_reads_as_a_pass(tmp_path):
    """issue 21 d: the plugin's results.json and junit.xml after a harness
    exception (not a check's failure) list the checks not run, marked crashed."""
    (tmp_path / "conftest.py").write_text(
        "import conformance.suite.execute as execute\n"
        "_real = execute.run_check\n"
        "def run_check(run, planned, res, *args, **kwargs):\n"
        "    if planned.id == 'snapshot-reuse':\n"
        "        raise MemoryError('out of memory in the oracle')\n"
        "    return _real(run, planned, res, *args, **kwargs)\n"
        "execute.run_check = run_check\n")
    report = tmp_path / "rep"
    proc = _pytest(tmp_path, "--hybrid-impl", "reference", "--hybrid-check", "mid-block-hits",
                   "--hybrid-check", "snapshot-reuse", "--hybrid-check", "tier-reuse", "--hybrid-examples", "2",
                   "--hybrid-report-dir", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = json.loads((report / "results.json").read_text())
    assert results["crashed"] == "MemoryError: out of memory in the oracle" and not results["summary"]["ok"]
    assert "snapshot-reuse" in results["not_run"]
    suite = ET.parse(report / "junit.xml").getroot()
    assert int(suite.get("errors")) >= 1
    assert "not run: the run crashed" in [c.find("error").get("message") for c in suite.iter("testcase")
                                          if c.find("error") is not None]
