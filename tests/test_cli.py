"""The command line: exit codes, usage errors, reports."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conformance.cli.main import main


def test_run_writes_results_and_junit(tmp_path):
    out = tmp_path / "r"
    code = main(["run", "--impl", "reference", "--check", "mid-block-hits", "--examples", "8",
                 "--report-dir", str(out)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert data["implementation"] == "reference" and data["seed"] == 0 and data["profile"] == "quick"
    (check,) = data["checks"]
    assert check["id"] == "mid-block-hits" and check["family"] == "mid-block" and check["status"] == "passed"
    assert check["examples"] == 8 and check["operations"] > 0 and check["test_cases"] >= 8
    assert data["coverage"]["mid_block_hits"] > 0
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0"


def test_mutant_run_exits_1_with_minimized_steps(tmp_path):
    out = tmp_path / "m"
    code = main(["run", "--mutant", "late-snapshot", "--check", "mid-block-hits", "--report-dir", str(out)])
    assert code == 1
    check = json.loads((out / "results.json").read_text())["checks"][0]
    assert check["status"] == "failed"
    assert 1 <= len(check["failure"]["operations"]) <= 8
    assert check["failure"]["repro"]


def test_every_repro_written_by_run_is_minimal(tmp_path):
    """By default run minimizes by replay: removing any one operation of the
    repro makes the failure go away (no inert submit-then-abort is left)."""
    from conformance.adapters.reference import ReferenceCache
    from conformance.harness.ops import op_from_dict
    from conformance.harness.oracle import Oracle
    from conformance.model import ModelConfig, TinyHybrid
    from conformance.results.repro import load
    from conformance.suite.minimize import replay_fails
    from fault_injection.catalog import get_mutant

    out = tmp_path / "m"
    assert main(["run", "--mutant", "late-snapshot", "--check", "mid-block-hits", "--check", "snapshot-reuse",
                 "--examples", "30", "--report-dir", str(out)]) == 1
    repros = sorted((out / "repros").glob("*.json"))
    assert len(repros) == 2
    for path in repros:
        repro = load(path)
        model = TinyHybrid(ModelConfig(**json.loads(path.read_text())["model"]))
        factory = get_mutant("late-snapshot").wrap(ReferenceCache)
        ops = [op_from_dict(d) for d in json.loads(path.read_text())["operations"]]
        exc, _ = replay_fails(factory, repro.impl_config, model, Oracle(model), ops)
        assert exc is not None and exc.kind == repro.failure["kind"]
        for i in range(len(ops)):
            exc, _ = replay_fails(factory, repro.impl_config, model, Oracle(model), ops[:i] + ops[i + 1:])
            assert exc is None or exc.kind != repro.failure["kind"], f"{path.name}: operation {i + 1} is inert"


@pytest.mark.parametrize("argv,needle", [
    (["run", "--impl", "no_such_module:Cache"], "cannot import no_such_module"),
    (["run", "--impl", "conformance.contract:Layout"], "does not meet the contract"),
    (["run", "--impl", "conformance.contract:Nope"], "no attribute"),
    (["run", "--profile", "huge"], "--profile"),
    (["run", "--check", "no-such-check"], "unknown check"),
    (["run", "--mutant", "no-such-mutant"], "unknown mutant"),
    (["run", "--bogus"], "unrecognized arguments"),
])
def test_usage_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_run_help_exits_0_with_the_help_alone():
    proc = subprocess.run([sys.executable, "-m", "conformance", "run", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--impl" in proc.stdout and proc.stderr == ""


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "conformance", "run", "--impl", "nope"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr


NOCACHE = """
from conformance.adapters.reference import ReferenceCache


class NoRetention(ReferenceCache):
    name = "no-retention"
    tier_option = None  # no second tier: the tier checks cannot run

    def retention(self):
        return None  # no declared policy: the retention checks cannot run
"""


def test_a_run_in_which_nothing_was_checked_exits_1(tmp_path, monkeypatch, capsys):
    """Every check skipped: not green. The console gives the count and each reason."""
    (tmp_path / "noret.py").write_text(NOCACHE)
    monkeypatch.chdir(tmp_path)  # imported from the current directory, as the CLI does
    out = tmp_path / "r"
    code = main(["run", "--impl", "noret:NoRetention", "--check", "tier-reuse", "--check", "retention-policy",
                 "--report-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "0 passed, 0 failed, 0 errors, 2 skipped" in err and "nothing was checked" in err
    assert "skipped tier-reuse: the implementation has no second tier" in err
    assert "skipped retention-policy: the implementation declares no retention policy" in err
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["skipped"] == 2 and data["summary"]["checked"] == 0 and data["summary"]["ok"] is False
    skipped = ET.parse(out / "junit.xml").getroot().findall("testcase/skipped")
    assert [s.get("message")[:30] for s in skipped] == ["the implementation has no seco",
                                                        "the implementation declares no"]
    assert "nothing was checked" in (out / "index.html").read_text()
    # compare: what was checked before and is skipped now is a regression, not a pass
    from conformance.results.compare import compare

    before = {"checks": [{"id": "tier-reuse", "status": "passed"}, {"id": "retention-policy", "status": "passed"}]}
    cmp = compare(before, data)
    assert cmp.regressed and cmp.nothing_checked and [c for c, _ in cmp.now_skipped] == ["tier-reuse",
                                                                                          "retention-policy"]
    # one check executed and passed, one skipped: green, with the skip on the console
    code = main(["run", "--impl", "noret:NoRetention", "--check", "tier-reuse", "--check", "mid-block-hits",
                 "--examples", "8", "--report-dir", str(tmp_path / "r2")])
    err = capsys.readouterr().err
    assert code == 0 and "1 passed, 0 failed, 0 errors, 1 skipped" in err and "skipped tier-reuse" in err


@pytest.mark.parametrize("argv,needle", [
    (["run", "--examples", "0"], "--examples: 0 must be at least 1"),
    (["run", "--steps", "-3"], "--steps: -3 must be at least 1"),
    (["run", "--block-size", "0"], "--block-size: 0 must be at least 1"),
    (["run", "--timeout", "0"], "--timeout: 0 must be a finite number above 0"),
    (["run", "--timeout", "-1"], "--timeout: -1 must be a finite number above 0"),
    (["run", "--timeout", "nan"], "--timeout: nan must be a finite number above 0"),
    (["run", "--workers", "0"], "--workers: 0 must be at least 1"),
    (["mutants", "--examples", "-1"], "--examples: -1 must be at least 1"),
    (["replay", "x.json", "--timeout", "0"], "--timeout: 0 must be"),
    (["run", "--option", "interval=3"], "retention interval 3 is not a multiple of the block size"),
    (["run", "--option", "interval=-4"], "retention interval must be None or an integer >= 0"),
    (["run", "--faults", "transfer-corrupt:p=1.5"], "a probability is between 0 and 1"),
    (["run", "--faults", "transfer-corrupt:p=-0.1"], "a probability is between 0 and 1"),
    (["run", "--faults", "transfer-corrupt:limit=0"], "limit=0: must be at least 1"),
    (["run", "--mutant", "vllm-groups-not-reconciled"], "a mutant of the vllm implementation, not of --impl "
                                                         "reference"),
    (["run", "--impl", "vllm-engine", "--profile", "standard"], "the vllm-engine adapter has the profiles"),
])
def test_bad_input_is_a_usage_error(capsys, tmp_path, argv, needle):
    assert main([*argv, "--report-dir", str(tmp_path / "never")] if argv[0] != "replay" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "never").exists()  # refused before anything ran or was written


def test_a_reference_mutant_on_another_implementation_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """The README's NoCache is not the reference: a reference mutant cannot wrap it."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (tmp_path / "nocache.py").write_text(next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                                              if "class NoCache" in b))
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--impl", "nocache:NoCache", "--mutant", "late-snapshot", "--report-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    assert "a mutant of the reference implementation, not of --impl nocache:NoCache" in capsys.readouterr().err


def test_results_and_repros_are_strict_json(tmp_path):
    """No Infinity or NaN: a reader in another language must parse them. Non-finite floats become strings."""
    from conformance.results import report
    from conformance.results.records import CheckResult, Failure, RunResult

    res = RunResult(implementation="x", implementation_version="1", seed=0, profile="quick", started="t",
                    impl_spec="mod:Cache", metrics={"hit_rate": float("nan"), "max": float("inf")})
    check = CheckResult(id="c", family="f", status="failed", metrics={"ratio": float("-inf")},
                        failure=Failure(kind="logits", message="m", operations=[{"op": "drain", "max_steps": 1}],
                                        seconds_to_failure=float("inf")))
    res.checks.append(check)
    report.write_failure_repro(tmp_path, res, check, {"block_size": 4})
    report.write_all(tmp_path, res)

    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    doc = json.loads((tmp_path / "results.json").read_text(), parse_constant=no_constants)
    assert doc["metrics"] == {"hit_rate": "nan", "max": "inf"} and doc["checks"][0]["metrics"]["ratio"] == "-inf"
    json.loads((tmp_path / "repros" / "c.json").read_text(), parse_constant=no_constants)
    # the printed replay command of a module:Class run carries --impl (replay never imports it from the file)
    junit = (tmp_path / "junit.xml").read_text()
    assert "replay: hybrid-conformance replay " in junit and "c.json --impl mod:Cache" in junit
    assert "c.json --impl mod:Cache" in (tmp_path / "index.html").read_text()


def test_report_folders_never_collide_and_say_mutant_and_faults(tmp_path):
    from conformance.suite.options import default_report_dir

    dirs = [default_report_dir("mod:Cache", 3, "late-snapshot", ("transfer-corrupt:p=0.5",), root=tmp_path)
            for _ in range(3)]  # the same second
    assert len(set(dirs)) == 3 and all(d.is_dir() for d in dirs)
    assert "mod_Cache-mutant-late-snapshot-faults-transfer-corrupt_p_0_5-s3" in dirs[0].name


def test_the_engine_adapter_without_vllm_checks_nothing_and_exits_1(tmp_path, capsys):
    """`run --impl vllm-engine` where no interpreter has vLLM: every check skipped with the
    reason on the console, "nothing was checked", exit 1 (it used to end green)."""
    import re

    nothing = tmp_path / "python"
    nothing.write_text("#!/bin/sh\nexit 1\n")  # an interpreter that has no vLLM (nor anything else)
    nothing.chmod(0o755)
    code = main(["run", "--impl", "vllm-engine", "--option", f"python={nothing}", "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(r"0 passed, 0 failed, 0 errors, \d+ skipped", err) and "nothing was checked" in err
    assert f"skipped engine-mid-block:qwen3next-tiny-sharp: vllm is not importable by {nothing}" in err


@pytest.mark.parametrize("flag,value", [("--kv-blocks", "1"), ("--kv-blocks", "-3"), ("--state-slots", "0"),
                                        ("--state-slots", "x")])
def test_pool_sizes_from_the_cli_are_validated(capsys, flag, value):
    assert main(["run", "--check", "mid-block-hits", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1


def test_pool_sizes_from_the_cli_reach_every_check(tmp_path):
    from conformance.suite.checks import get_check
    from conformance.suite.execute import check_impl_config
    from conformance.suite.prepared import PoolSizes

    cfg = check_impl_config(get_check("eviction-pressure"), {}, PoolSizes(num_kv_blocks=40, num_state_slots=12))
    assert (cfg.num_kv_blocks, cfg.num_state_slots) == (40, 12)
    out = tmp_path / "pool"
    assert main(["run", "--check", "mid-block-hits", "--examples", "4", "--kv-blocks", "40", "--state-slots", "12",
                 "--report-dir", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["impl_config"]["num_kv_blocks"] == 40 and data["impl_config"]["num_state_slots"] == 12
