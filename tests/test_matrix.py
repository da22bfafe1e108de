"""Several runs (reference, vLLM at both levels, SGLang) as one matrix by family."""

import json

from conformance.cli.main import main as cli
from conformance.results.matrix import format_matrix


def _run(impl, version, statuses, options=None):
    return {"implementation": impl, "implementation_version": version, "impl_config": {"options": options or {}},
            "checks": [{"id": cid, "family": fam, "status": st, **({"reason": "no tier"} if st == "skipped" else {})}
                       for cid, fam, st in statuses]}


RUNS = [_run("reference", "1.0", [("mid-block-hits", "mid-block", "passed"), ("tier-reuse", "tier", "passed")]),
        _run("vllm", "0.33.0", [("mid-block-hits", "mid-block", "failed"), ("tier-reuse", "tier", "passed")],
             {"prefix_match_unit": 1}),
        _run("sglang", "0.5.23", [("mid-block-hits", "mid-block", "failed"), ("tier-reuse", "tier", "skipped")])]


def test_one_row_per_run_one_column_per_family():
    text = format_matrix(RUNS).splitlines()
    assert text[0].split() == ["mid-block", "tier"]
    assert text[1].split()[-2:] == ["pass", "pass"]
    assert "vllm 0.33.0 [prefix_match_unit=1]" in text[2] and text[2].split()[-2:] == ["FAIL", "pass"]
    assert text[3].split()[-2:] == ["FAIL", "skip"]  # a skipped family reads as skipped, never as passed


def _write(tmp_path, runs) -> list[str]:
    paths = []
    for i, r in enumerate(runs):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    return paths


def test_matrix_command_writes_html(tmp_path, capsys):
    paths = _write(tmp_path, RUNS)
    # rows with failures that no expectations file judges: the matrix is not green (issue 21 i)
    assert cli(["matrix", *paths, "--html", str(tmp_path / "m.html")]) == 1
    out = capsys.readouterr().out
    assert "FAIL sglang 0.5.23: not as expected by " in out and "sglang-0.5.23.toml" in out
    assert "ok   reference 1.0: passed" in out
    html = (tmp_path / "m.html").read_text()
    assert "sglang 0.5.23" in html and "reference 1.0" in html
    assert cli(["matrix", paths[0]]) == 0  # a green row alone
    assert cli(["matrix", str(tmp_path / "missing.json")]) == 2


def test_a_failing_row_judged_as_expected_is_green(tmp_path):
    from conformance.cli.cmd_matrix import row_verdict

    row = _run("myengine", "2.0", [("mid-block-hits", "mid-block", "failed"), ("tier-reuse", "tier", "passed")])
    row["impl_spec"] = "myengine"
    row["checks"][0]["failure"] = {"kind": "coverage", "message": "mid_block_hits stayed at 0"}
    (tmp_path / "myengine-2.0.toml").write_text(
        'engine = "myengine"\nversion = "2.0"\nimpl = "myengine"\n[checks."mid-block-hits"]\nstatus = "failed"\n'
        'kind = "coverage"\n')
    green, why = row_verdict(row, tmp_path)
    assert green and "as expected by" in why
    row["checks"][0]["failure"]["kind"] = "logits"  # failing otherwise than expected: not green
    assert row_verdict(row, tmp_path)[0] is False
    assert row_verdict(row)[0] is False  # no file for it in fixtures/expectations/
    row["interrupted"] = True
    assert row_verdict(row, tmp_path) == (False, "myengine 2.0: interrupted (its results are incomplete)")
