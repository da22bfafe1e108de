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


def test_matrix_command_writes_html(tmp_path, capsys):
    paths = []
    for i, r in enumerate(RUNS):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    assert cli(["matrix", *paths, "--html", str(tmp_path / "m.html")]) == 0
    html = (tmp_path / "m.html").read_text()
    assert "sglang 0.5.23" in html and "reference 1.0" in html
    assert cli(["matrix", str(tmp_path / "missing.json")]) == 2
