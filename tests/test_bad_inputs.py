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

from conformance.cli.main import main as cli

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


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "afile").write_text("x")
    (d / "notjson.json").write_text("{not json")
    locked = d / "locked"
    locked.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (locked / ".lock").write_text(f"{holder.pid}\n")
    (locked / "results.json").write_text('{"checks": []}\n')  # the other run's: must stay as it is
    yield {"file": str(d / "afile"), "notjson": str(d / "notjson.json"), "locked": str(locked),
           "disagg_len": _repro(d / "len.json", {"op": "disagg-submit", "request_id": "a", "prompt_len": -5}),
           "disagg_new": _repro(d / "new.json", {"op": "disagg-submit", "request_id": "a", "prompt_len": 4,
                                                 "max_new": "x"}),
           "disagg_count": _repro(d / "count.json", {"op": "disagg-step", "count": 0}), "dir": d}
    holder.kill()


@pytest.mark.parametrize("what, command, code, message", rows(), ids=[r[0] for r in rows()])
def test_each_bad_input(places, tmp_path, monkeypatch, capsys, what, command, code, message):
    if command.startswith("run --report-dir /proc") and not Path("/proc/self").exists():
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
    assert message in err[0], err[0]
    assert not never.exists() and not (tmp_path / "reports").exists()  # refused before anything was written
    assert sorted(p.name for p in Path(places["locked"]).iterdir()) == before
    assert (Path(places["locked"]) / "results.json").read_text() == '{"checks": []}\n'
