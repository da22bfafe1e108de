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
    assert check["examples"] > 0 and check["steps"] > 0
    assert data["coverage"]["mid_block_hits"] > 0
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0"


def test_mutant_run_exits_1_with_minimized_steps(tmp_path):
    out = tmp_path / "m"
    code = main(["run", "--mutant", "late-snapshot", "--check", "mid-block-hits", "--report-dir", str(out)])
    assert code == 1
    check = json.loads((out / "results.json").read_text())["checks"][0]
    assert check["status"] == "failed"
    assert 1 <= len(check["failure"]["steps"]) <= 8
    assert check["failure"]["repro"]


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


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "conformance", "run", "--impl", "nope"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr


@pytest.mark.parametrize("flag,value", [("--kv-blocks", "1"), ("--kv-blocks", "-3"), ("--state-slots", "0"),
                                        ("--state-slots", "x")])
def test_pool_sizes_from_the_cli_are_validated(capsys, flag, value):
    assert main(["run", "--check", "mid-block-hits", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1


def test_pool_sizes_from_the_cli_reach_every_check(tmp_path):
    from conformance.suite.checks import get_check
    from conformance.suite.execute import check_impl_config
    from conformance.suite.options import RunOptions

    cfg = check_impl_config(get_check("eviction-pressure"), RunOptions(num_kv_blocks=40, num_state_slots=12))
    assert (cfg.num_kv_blocks, cfg.num_state_slots) == (40, 12)
    out = tmp_path / "pool"
    assert main(["run", "--check", "mid-block-hits", "--examples", "4", "--kv-blocks", "40", "--state-slots", "12",
                 "--report-dir", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["impl_config"]["num_kv_blocks"] == 40 and data["impl_config"]["num_state_slots"] == 12
