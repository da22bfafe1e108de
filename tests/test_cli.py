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
