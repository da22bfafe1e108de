"""docs/bad-inputs.md is true: every row of its table, run here, exits with its
code and one line that holds its message, and writes nothing."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.cli.main import main as cli
from conformance.results.report import clear_previous_run
from conformance.suite.merge import main as merge_main
from conformance.suite.options import RunOptions
from conformance.suite.prepare import prepare_run
from conformance.suite.run import run
from conformance.suite.single import run_single_check

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad-inputs.md"


def rows() -> list[tuple[str, str, int, str]]:
    out = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| ([^|]+) \| `([^`]+)` \| (\d+) \| `(.+)` \|$", line)
        if m:
            out.append((m.group(1).strip(), m.group(2), int(m.group(3)), m.group(4)))
    return out


def test_the_table_is_there():
    assert len(rows()) >= 40


def _repro(path: Path, op: dict) -> str:
    path.write_text(json.dumps({"schema": "hybrid-cache-conformance/repro", "schema_version": 3, "impl": "reference",
                                "operations": [op, {"op": "disagg-drain"}]}))
    return str(path)


SCENARIO = ROOT / "fixtures" / "scenarios" / "snapshot-copy-drops-conv.json"


def _damaged(path: Path, **change) -> str:
    """The scenario with ``change`` applied: one damaged field each."""
    doc = json.loads(SCENARIO.read_text())
    doc.update(change)
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "afile").write_text("x")
    (d / "notjson.json").write_text("{not json")
    (d / "nonutf8.json").write_bytes(b"\xff\xfe{")
    (d / "bad.toml").write_bytes(b'engine = "reference"\nversion = "1.0"\n# \xff\n')
    (d / "results").mkdir()
    (d / "results" / "results.json").write_text('{"checks": []}\n')
    (d / "shape.json").write_text('{"checks": [1]}\n')
    pools = {"block_size": 4, "num_kv_blocks": 10**12, "num_state_slots": 24, "options": {}}
    damaged = {"r_model": _damaged(d / "model.json", model={"hidden": 0}),
               "r_check": _damaged(d / "check.json", check="no-such-check"),
               "r_kind": _damaged(d / "kind.json", failure={"kind": "bogus"}),
               "r_mutant": _damaged(d / "mutant.json", mutant="no-such-mutant"),
               "r_other": _damaged(d / "other.json", mutant="vllm-groups-not-reconciled"),
               "r_faults": _damaged(d / "faults.json", faults=["nope"]),
               "r_pool": _damaged(d / "pool.json", impl_config=pools)}
    locked = d / "locked"
    locked.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (locked / ".lock").write_text(f"{holder.pid}\n")
    (locked / "results.json").write_text('{"checks": []}\n')  # the other run's: must stay as it is
    yield {"file": str(d / "afile"), "notjson": str(d / "notjson.json"), "locked": str(locked),
           "disagg_len": _repro(d / "len.json", {"op": "disagg-submit", "request_id": "a", "prompt_len": -5}),
           "disagg_new": _repro(d / "new.json", {"op": "disagg-submit", "request_id": "a", "prompt_len": 4,
                                                 "max_new": "x"}),
           "disagg_count": _repro(d / "count.json", {"op": "disagg-step", "count": 0}), "dir": str(d),
           "nonutf8": str(d / "nonutf8.json"), "badtoml": str(d / "bad.toml"), "long": "x" * 300,
           "results": str(d / "results"), "badshape": str(d / "shape.json"),
           "vllm_toml": str(ROOT / "fixtures" / "expectations" / "vllm-0.33.0.toml"), **damaged}
    holder.kill()


@pytest.mark.parametrize("what, command, code, message", rows(), ids=[r[0] for r in rows()])
def test_each_bad_input(places, tmp_path, monkeypatch, capsys, what, command, code, message):
    if ("/proc/" in command or "/dev/zero" in command) and not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command.format(**places))
    never = tmp_path / "never"
    if argv[0] in ("run", "mutants") and "--report-dir" not in argv:
        argv += ["--report-dir", str(never)]
    before = sorted(p.name for p in Path(places["locked"]).iterdir())
    assert cli(argv) == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("hybrid-conformance: error: "), err
    assert "Traceback" not in err[0] and message.format(**places) in err[0], err[0]
    assert not never.exists() and not (tmp_path / "reports").exists()  # refused before anything was written
    assert sorted(p.name for p in Path(places["locked"]).iterdir()) == before
    assert (Path(places["locked"]) / "results.json").read_text() == '{"checks": []}\n'


# -- the same family, where the answer is not a usage error ------------------------------------------


class ViewReturnsNone(ReferenceCache):
    """A view() that forgot its return: the implementation's contract failure."""

    def view(self):
        super().view()


def test_a_view_that_is_not_a_cacheview_is_the_contract_not_the_harness():
    """Before, the first checker to read the view crashed (kind harness: the
    suite blamed itself) on a None the implementation returned."""
    res = run_single_check(ViewReturnsNone, "mid-block-hits",
                           RunOptions(examples=2, steps=4, seed=0, write_reports=False))
    assert res.status == "failed" and res.failure.kind == "contract", (res.status, res.failure)
    assert "view() returned NoneType, not CacheView" in res.failure.message


def test_a_check_named_twice_runs_once(tmp_path):
    run = prepare_run(RunOptions(checks=("mid-block-hits", "chunked-prefill", "mid-block-hits"), matrix=False,
                                 write_reports=False))
    assert [p.id for p in run.checks] == ["mid-block-hits", "chunked-prefill"]


def _fake_repro(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": "hybrid-cache-conformance/repro", "schema_version": 3}, indent=2))


def test_a_second_run_into_a_report_directory_holds_only_its_own_files(tmp_path):
    """A run's report directory holds that run's files only: what a previous
    run wrote there (its repros above all, which would read as this run's
    findings) is cleared, and nothing else is touched."""
    out = tmp_path / "r"
    for name in ("results.json", "junit.xml", "index.html", "cache-metrics.png", "results.json.tmp"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old")
    _fake_repro(out / "repros" / "mid-block-hits--late-snapshot.json")
    _fake_repro(out / "repros" / "known" / "some-defect" / "mid-block-hits.json")
    (out / "notes.txt").write_text("mine")  # the user's: stays
    (out / "repros" / "README").write_text("mine")  # stays, and so does its folder
    (out / "repros" / "other.json").write_text('{"not": "a repro"}')  # another tool's JSON: stays
    result = run(RunOptions(checks=("mid-block-hits",), examples=2, steps=4, report_dir=out))
    assert result.ok
    left = {str(p.relative_to(out)) for p in out.rglob("*")} - {"cache-metrics.png"}  # a plot needs matplotlib
    assert left == {"index.html", "junit.xml", "notes.txt", "repros", "repros/README", "repros/other.json",
                    "results.json"}, left
    assert not (out / "repros" / "known").exists() and not (out / "results.json.tmp").exists()
    assert (out / "notes.txt").read_text() == "mine" and json.loads((out / "results.json").read_text())["checks"]


def test_clearing_leaves_a_folder_of_other_files_alone(tmp_path):
    (tmp_path / "repros").mkdir()
    (tmp_path / "repros" / "a.json").write_text("[]")
    (tmp_path / "results.json").mkdir()  # not a file: not ours to remove
    assert clear_previous_run(tmp_path) == []
    assert (tmp_path / "repros" / "a.json").exists() and (tmp_path / "results.json").is_dir()


def test_a_merge_into_one_of_its_shards_is_refused(tmp_path):
    shard = tmp_path / "s1"
    shard.mkdir()
    (shard / "results.json").write_text('{"checks": []}\n')
    assert merge_main([str(shard), str(shard)]) == 2
