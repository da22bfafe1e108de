"""One verdict behind every door (issue 34, items 1, 2 and 4, findings e-i
and l): the verdict is a value the core returns and every format renders;
an incomplete run -- pending, killed, interrupted, crashed by its adapter,
merged from incomplete shards -- is never green; an implementation that
ends the process, raises SystemExit or KeyboardInterrupt, or does not repeat
itself is reported as the implementation's failure."""

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

from conformance.cli.main import main as cli
from conformance.results.records import RunResult
from conformance.results.verdict import judge_run

ROOT = Path(__file__).resolve().parent.parent


def _env(*extra: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, extra),
                                                         os.environ.get("PYTHONPATH", "")])}


def _doc(checks, **top) -> dict:
    return {"implementation": "reference", "implementation_version": "1.0", "seed": 0, "profile": "quick",
            "started": "t", "finished": "t2", "checks": checks, **top}


def _c(cid, status, kind=None, message="m"):
    return {"id": cid, "family": "f", "status": status,
            **({"failure": {"kind": kind, "message": message}} if kind else {})}


# -- the value ------------------------------------------------------------------------------


def test_the_verdict_value_and_its_precedence():
    ok = judge_run(_doc([_c("mid-block-hits", "passed"), _c("tier-reuse", "skipped")]))
    assert ok.status == "passed" and ok.ok and ok.exit_code == 0 and ok.expectations is None
    assert [c.status for c in ok.checks] == ["passed", "skipped"] and "raw verdict" in ok.note
    raw = judge_run(_doc([_c("mid-block-hits", "failed", "logits")]))
    assert raw.status == "new" and raw.check("mid-block-hits").status == "new" and raw.exit_code == 1
    pending = judge_run(_doc([_c("mid-block-hits", "passed")], finished=None, not_run=["snapshot-reuse"]))
    assert pending.status == "incomplete" and pending.check("snapshot-reuse").status == "not-run"
    assert pending.check("snapshot-reuse").why == "pending" and not pending.ok
    assert "the run did not finish" in pending.headline()
    nothing = judge_run(_doc([_c("tier-reuse", "skipped")]))
    assert nothing.status == "incomplete" and "nothing was checked" in nothing.headline()
    crashed = judge_run(_doc([_c("mid-block-hits", "failed", "logits")], interrupted=True, crashed="MemoryError: x",
                             not_run=["snapshot-reuse"]))
    assert crashed.status == "new" and any("crashed" in why for why in crashed.incomplete)
    assert "INCOMPLETE" in crashed.headline()
    elsewhere = judge_run(_doc([_c("mid-block-hits", "passed")], expectations={"path": "/nowhere/x-1.toml"}))
    assert elsewhere.status == "passed" and "is not here" in elsewhere.note  # a file of another machine


def test_results_json_junit_and_html_of_a_pending_run_read_incomplete(tmp_path):
    """Every planned check is written "not run: pending" before the first check runs."""
    from conformance.results.report import write_all

    result = RunResult(implementation="reference", implementation_version="1.0", seed=0, profile="quick",
                       started="t", planned=["mid-block-hits", "snapshot-reuse"],
                       not_run=["mid-block-hits", "snapshot-reuse"])
    write_all(tmp_path, result)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["verdict"]["status"] == "incomplete" and not doc["verdict"]["ok"] and not doc["summary"]["ok"]
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("tests") == "2" and suite.get("errors") == "2"
    assert {c.find("error").get("message") for c in suite.iter("testcase")} == {"not run: pending"}
    html = (tmp_path / "index.html").read_text()
    assert "not run: pending" in html and "badge ok" not in html
    assert cli(["matrix", str(tmp_path)]) == 1


# -- the implementation ends the process or raises SystemExit / KeyboardInterrupt (finding e) -----------

ENDS = """
import os, sys
from conformance.adapters.reference import ReferenceCache


class SysExit(ReferenceCache):
    def schedule(self, budget):
        sys.exit(0)


class CtrlC(ReferenceCache):
    def schedule(self, budget):
        raise KeyboardInterrupt


class OsExit(ReferenceCache):
    def schedule(self, budget):
        os._exit(0)


class Sleeps(ReferenceCache):
    def schedule(self, budget):
        import time
        time.sleep(600)
"""


@pytest.fixture(scope="module")
def ends(tmp_path_factory):
    d = tmp_path_factory.mktemp("ends")
    (d / "ends.py").write_text(ENDS)
    (d / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    return d


def _console(ends: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The console entry point, as a user runs it (supervised)."""
    return subprocess.run([sys.executable, "-m", "conformance", *argv], cwd=ends, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("cls", ["SysExit", "CtrlC"])
def test_system_exit_and_keyboard_interrupt_of_the_implementation_are_its_failure(ends, tmp_path, cls):
    out = tmp_path / "r"
    proc = _console(ends, "run", "--impl", f"ends:{cls}", "--check", "mid-block-hits", "--examples", "2",
                    "--report-dir", str(out))
    assert proc.returncode == 1, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    c = doc["checks"][0]
    assert c["status"] == "error" and c["failure"]["kind"] == "raised"
    assert ("SystemExit(0)" if cls == "SysExit" else "KeyboardInterrupt()") in c["failure"]["message"]
    assert not doc["interrupted"] and doc["verdict"]["status"] == "new"


def test_system_exit_at_import_is_a_usage_error(ends):
    proc = _console(ends, "run", "--impl", "exits_on_import:X", "--check", "mid-block-hits")
    assert proc.returncode == 2 and "raised SystemExit(0)" in proc.stderr, proc.stderr


def test_os_exit_in_the_implementation_is_a_crashed_run_exit_1(ends, tmp_path):
    """The supervisor renders what the dead process cannot: exit 1 and an incomplete report."""
    out = tmp_path / "r"
    proc = _console(ends, "run", "--impl", "ends:OsExit", "--check", "mid-block-hits", "--check", "snapshot-reuse",
                    "--examples", "2", "--report-dir", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "the run's process died (exit status 0)" in proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["crashed"] == "the run's process died (exit status 0)" and doc["finished"]
    assert doc["verdict"]["status"] == "incomplete" and doc["not_run"] == ["mid-block-hits", "snapshot-reuse"]
    assert not (out / ".lock").exists()
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("errors") == "2"


def test_a_real_ctrl_c_during_an_implementation_call_still_stops_the_run(ends, tmp_path):
    """Told apart from the implementation's own KeyboardInterrupt: the signal handlers record that it arrived."""
    out = tmp_path / "r"
    script = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from conformance.cli.main import main; sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, "run", "--impl", "ends:Sleeps", "--check", "mid-block-hits",
                             "--timeout", "600", "--report-dir", str(out)], cwd=ends, env=_env(ends),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "results.json").exists():
            time.sleep(0.2)
        time.sleep(3)  # inside schedule() by now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["interrupted"] and doc["not_run"] == ["mid-block-hits"] and doc["verdict"]["status"] == "incomplete"


# -- a run killed at any moment (finding g) ------------------------------------------------------

def test_a_sigkilled_run_leaves_an_incomplete_report(tmp_path):
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "conformance", "run", "--check", "mid-block-hits",
                             "--check", "snapshot-reuse", "--examples", "400", "--report-dir", str(out)],
                            cwd=ROOT, env={**_env(), "HCC_NO_SUPERVISOR": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "results.json").exists():
            time.sleep(0.1)
        time.sleep(1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    doc = json.loads((out / "results.json").read_text())
    assert doc["finished"] is None and not doc["summary"]["ok"] and doc["verdict"]["status"] == "incomplete"
    assert "mid-block-hits" in doc["not_run"]
    suite = ET.parse(out / "junit.xml").getroot()
    assert int(suite.get("errors")) >= 1 and "not run: pending" in (out / "junit.xml").read_text()
    assert cli(["matrix", str(out)]) == 1
    assert "badge ok" not in (out / "index.html").read_text()


def test_a_worker_that_dies_is_noticed_never_waited_for(ends, tmp_path):
    """finding l: with --workers 2, an adapter calling os._exit hung the whole run."""
    out = tmp_path / "r"
    proc = _console(ends, "run", "--impl", "ends:OsExit", "--workers", "2", "--check", "mid-block-hits",
                    "--check", "snapshot-reuse", "--examples", "2", "--report-dir", str(out), timeout=400)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["finished"] and not doc["crashed"] and doc["not_run"] == ["mid-block-hits", "snapshot-reuse"]
    assert doc["not_run_reasons"]["mid-block-hits"] == "its worker process died (exit status 0)"
    assert doc["verdict"]["status"] == "incomplete" and "NOT RUN: its worker process died" in proc.stderr


# -- shards (finding f) ------------------------------------------------------------------------

def test_a_merge_with_a_missing_shard_is_incomplete(tmp_path, capsys):
    from conformance.suite.merge import main as merge_main
    from conformance.suite.run import RunOptions, run

    opts = dict(checks=("mid-block-hits", "chunked-prefill", "snapshot-reuse"), examples=1, steps=2)
    for i in (1, 2):
        run(RunOptions(**opts, shard=(i, 3), report_dir=tmp_path / f"s{i}"))
    doc = json.loads((tmp_path / "s1" / "results.json").read_text())
    assert doc["shard"] == "1/3" and doc["unsplit"] == list(opts["checks"])
    code = merge_main([str(tmp_path / "all"), str(tmp_path / "s1"), str(tmp_path / "s2")])
    out = capsys.readouterr().out
    assert code == 1 and "MISSING shards 3/3" in out and "INCOMPLETE" in out
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    assert merged["not_run"] == ["snapshot-reuse"]
    assert merged["not_run_reasons"]["snapshot-reuse"] == "shard 3/3 missing"
    # (one example per check fails some on coverage: the verdict is NEW, and says it is incomplete too)
    assert any("shard 3/3 missing" in why for why in merged["verdict"]["incomplete"]) and not merged["summary"]["ok"]
    assert "not run: shard 3/3 missing" in (tmp_path / "all" / "junit.xml").read_text()
    assert cli(["matrix", str(tmp_path / "all")]) == 1
    # shards of different splits are not one run
    run(RunOptions(**opts, shard=(2, 4), report_dir=tmp_path / "other"))
    assert merge_main([str(tmp_path / "bad"), str(tmp_path / "s1"), str(tmp_path / "other")]) == 2


# -- an implementation that does not repeat itself (item 4, finding i) ----------------------------

ONCE = """
from dataclasses import replace

from conformance.adapters.reference import ReferenceCache
from conformance.contract import FRESH


class WrongOnce(ReferenceCache):
    \"\"\"Wrong the first time in the process that a request starts from a cached state (it starts its recurrent
    state from nothing instead), right ever after: what a cache that iterates a set of objects hashed by
    address does, by chance; here on purpose, so that the test is certain.\"\"\"

    done = False

    def schedule(self, budget):
        plan = super().schedule(budget)
        if type(self).done:
            return plan
        steps = []
        for s in plan.requests:
            if s.start > 0 and s.state_init != FRESH and not type(self).done:
                type(self).done = True
                s = replace(s, state_init=FRESH)
            steps.append(s)
        return replace(plan, requests=tuple(steps))
"""


def test_a_nondeterministic_implementation_is_reported_as_such(tmp_path, monkeypatch):
    from conformance.suite.run import RunOptions, run

    (tmp_path / "once.py").write_text(ONCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from once import WrongOnce  # type: ignore[import-not-found]

    result = run(RunOptions(impl=WrongOnce, checks=("mid-block-hits",), examples=10, steps=6,
                            report_dir=tmp_path / "r"))
    c = result.checks[0]
    assert c.status == "failed" and c.failure is not None, c
    assert c.failure.kind == "nondeterministic", c.failure.message
    assert "did not fail again" in c.failure.message and "FlakyFailure" not in c.failure.message
    assert c.failure.operations and c.failure.repro  # the first failure, as it happened, with its repro
    assert result.verdict is not None and result.verdict.status == "new"
    # its repro replays by comparing runs (docs/repro-format.md): the first run in a process is wrong again
    monkeypatch.setattr(WrongOnce, "done", False)
    assert cli(["replay", c.failure.repro, "--impl", "once:WrongOnce", "--quiet"]) == 1


# -- the rest of finding l ----------------------------------------------------------------------

OUT_OF_RANGE = """
from dataclasses import replace

from conformance.adapters.reference import ReferenceCache


class PastThePool(ReferenceCache):
    def schedule(self, budget):
        plan = super().schedule(budget)
        if not plan.requests:
            return plan
        first = plan.requests[0]
        table = (first.block_table[0] + 1000,) + tuple(first.block_table[1:])
        return replace(plan, requests=(replace(first, block_table=table),) + tuple(plan.requests[1:]))
"""


def test_a_block_id_past_the_pool_is_out_of_range_not_a_refcount(tmp_path, monkeypatch):
    from conformance.suite.run import RunOptions, run

    (tmp_path / "pastpool.py").write_text(OUT_OF_RANGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from pastpool import PastThePool  # type: ignore[import-not-found]

    result = run(RunOptions(impl=PastThePool, checks=("mid-block-hits",), examples=1, steps=2, shrink="none",
                            write_reports=False))
    f = result.checks[0].failure
    assert f is not None and f.kind == "contract", f
    assert "out of range" in f.message and "refcount" not in f.message, f.message


def test_the_guard_keeps_an_outer_timer_running():
    """pytest-timeout's signal method arms ITIMER_REAL: a guarded call used to disarm it for good."""
    from conformance.harness.guard import guarded

    fired: list[float] = []
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(time.monotonic() - start))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        assert guarded("a call", lambda: 7, timeout=30) == 7  # a short call: the outer timer goes on
        guarded("a long call", time.sleep, 1.0, timeout=30)  # the outer timer comes due inside the call
        assert len(fired) == 1 and 0.5 < fired[0] < 0.95, fired
        signal.setitimer(signal.ITIMER_REAL, 5)
        with pytest.raises(Exception, match="did not return within 0.2 s"):
            guarded("a hang", time.sleep, 2, timeout=0.2)  # the call's own timeout, first
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 4 < remaining <= 5  # and the outer timer re-armed for what is left of it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_pytest_timeout_still_works_around_guarded_calls(tmp_path):
    """finding l: a 4 s pytest-timeout limit let an 18 s test pass (the guard disarmed its timer)."""
    pytest.importorskip("pytest_timeout")
    (tmp_path / "test_user.py").write_text(
        "import time\nimport pytest\nfrom conformance.harness.guard import guarded\n\n"
        "@pytest.mark.timeout(2, method='signal')\ndef test_after_a_call():\n"
        "    guarded('a call', time.sleep, 0.1, timeout=30)\n    time.sleep(8)\n\n"
        "@pytest.mark.timeout(2, method='signal')\ndef test_inside_a_call():\n"
        "    guarded('a long call', time.sleep, 8, timeout=30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "2 failed" in out and "Timeout" in out, out
    assert time.monotonic() - start < 60


def test_the_engine_level_is_a_kind_of_run():
    """--impl vllm-engine is prepared by prepare_run and executed by the one execute(), not a second path."""
    from conformance.errors import UsageError
    from conformance.suite.options import RunOptions
    from conformance.suite.prepare import prepare_run

    run = prepare_run(RunOptions(impl="vllm-engine", write_reports=False))
    assert run.engine is not None and run.checks == () and run.planned_ids == list(run.engine.planned)
    assert "engine-mid-block:qwen3next-tiny-sharp" in run.planned_ids
    for bad, flag in ((dict(workers=2), "--workers"), (dict(examples=3), "--examples"),
                      (dict(profile="standard"), "--profile"), (dict(checks=("mid-block-hits",)), "--check")):
        with pytest.raises(UsageError, match=flag):
            prepare_run(RunOptions(impl="vllm-engine", write_reports=False, **bad))
