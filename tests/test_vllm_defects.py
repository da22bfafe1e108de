"""vLLM's known defects (fixtures/expectations/vllm-0.33.0.toml): every pinned
repro reproduces on the installed version, a fix that removes a defect's cause
makes the run say FIXED for it, and seeded bugs placed where the sub-block
defects also fire are named NEW beside them.  Needs vLLM (skipped without)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from conformance.cli.main import main as cli  # noqa: E402


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


@pytest.fixture(scope="module")
def table():
    from conformance.suite.known import expectations_for

    exp = expectations_for("vllm", _vllm_version())
    if exp is None:
        pytest.skip(f"no expectations file for vllm {_vllm_version()}")
    return exp


def test_every_pinned_repro_reproduces_on_its_own_version(table, capsys):
    assert cli(["defects", "--impl", "vllm", "--replay", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert out.count("reproduces   ") == len(table.table.open())


def test_a_fix_of_a_defects_cause_makes_its_pinned_repro_stop_reproducing(table):
    from conformance.adapters.vllm import VllmCache
    from conformance.suite.known import replay_pinned
    from fault_injection.catalog import get_mutant

    fix = get_mutant("vllm-fix-sub-block-boundary-stop")
    assert fix.fixes == "subblock-registration" and fix.bug_class == "FIX"
    outcomes = {r["defect"]: r["outcome"] for r in replay_pinned(table, fix.wrap(VllmCache), None, None, 120)}
    assert outcomes.pop("subblock-registration") == "fixed"
    assert set(outcomes.values()) == {"reproduces"}  # the fix removes that cause only


def test_a_fix_for_a_defect_the_version_does_not_have_is_a_usage_error(table, capsys):
    from conformance.suite.known import check_fix_target

    check_fix_target("vllm-fix-sub-block-boundary-stop", table)
    from dataclasses import replace

    from conformance.errors import UsageError
    from conformance.suite.known import Expectations

    empty = Expectations(table.path, table.doc, replace(table.table, defects={}))
    with pytest.raises(UsageError, match="not a known defect"):
        check_fix_target("vllm-fix-sub-block-boundary-stop", empty)


@pytest.mark.parametrize("mutant", ["vllm-sub-block-copy-dropped", "vllm-sub-block-hit-one-token-long"])
def test_a_seeded_bug_where_a_known_defect_also_fires_is_named_new(mutant, tmp_path):
    out = tmp_path / "r"
    code = cli(["run", "--impl", "vllm", "--mutant", mutant, "--check", "chunked-prefill[prefix_match_unit=1]",
                "--report-dir", str(out), "--timeout", "120"])
    doc = json.loads((out / "results.json").read_text())
    assert code == 1
    t = doc["triage"]
    assert t["by_check"]["chunked-prefill[prefix_match_unit=1]"] == "NEW", t
    assert doc["checks"][0]["failure"]["defect"] is None
