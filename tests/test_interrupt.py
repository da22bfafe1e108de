"""Ctrl-C (SIGINT) or a CI cancel (SIGTERM) in the middle of a run leaves a
valid results.json for the checks that finished, marked interrupted, and
every repro file found so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The run under test (shrinking off, so that the first (mutant) check fails in
# seconds) with every later check made slow, so that the signal surely lands
# while a check is running.
SCRIPT = """
import faulthandler, inspect, signal, sys, time
# Ctrl-C as a terminal delivers it: a test suite started from a background job
# (`cmd &`, nohup) inherits SIGINT ignored, and Python then ignores it too (the
# run slept through the signal: seen twice, 2026-12-02 and -03).
signal.signal(signal.SIGINT, signal.default_int_handler)
# If the run ever outlives its signal, the test asks for every thread's stack.
faulthandler.register(signal.SIGUSR1)
import conformance.suite.run
_run_check = conformance.suite.run.run_check
_signature = inspect.signature(_run_check)
def slow_after_first(*args, **kw):
    if _signature.bind(*args, **kw).arguments["planned"].position > 1:  # the check's place in the plan
        time.sleep(600)
    return _run_check(*args, **kw)
conformance.suite.run.run_check = slow_after_first
from conformance.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_keeps_valid_results_and_repros(tmp_path, sig):
    out = tmp_path / "rep"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "run", "--mutant", "late-snapshot", "--profile", "standard",
                             "--examples", "400", "--steps", "6", "--shrink", "none", "--report-dir", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = out / "results.json"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and len(json.loads(results.read_text())["checks"]) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run finished before it could be interrupted: " + proc.stderr.read()
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the run did not stop within 120 s of {sig.name}; its stderr and stacks:\n{err}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err
    doc = json.loads(results.read_text())
    assert doc["interrupted"] is True and doc["finished"]
    assert len(doc["checks"]) == 2  # what finished, not what was planned
    failed = [c for c in doc["checks"] if c["status"] == "failed"]
    assert failed
    for c in failed:
        repro = Path(c["failure"]["repro"])
        assert repro.exists() and json.loads(repro.read_text())["operations"]
    assert (out / "index.html").exists() and "interrupted" in (out / "index.html").read_text()
    # The checks that did not run are listed, never dropped: junit.xml must not read as a pass.
    from conformance.suite.checks import PROFILES

    planned = len(PROFILES["standard"].checks)
    assert len(doc["not_run"]) == planned - 2 and doc["summary"]["not_run"] == planned - 2
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == str(planned) and int(suite.get("errors")) >= planned - 2
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["interrupted"] == "true" and props["not_run"] == str(planned - 2)
    not_run = [c for c in suite.iter("testcase") if c.find("error") is not None
               and c.find("error").get("message") == "not run: interrupted"]
    assert [c.get("name") for c in not_run] == doc["not_run"]
    assert not (out / ".lock").exists()  # the report directory is released
