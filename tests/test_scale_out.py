"""--shard i/n splits the checks over CI runners; --workers N runs them in
processes on one machine.  Both run each check with the seed of the unsplit
run (a check's seed is its position in the profile), and draw its examples
(Hypothesis draws no constants from the modules a process happens to have
loaded while our checks run: ``stable_draws``)."""

from __future__ import annotations

import pytest

from conformance.cli.main import main as cli
from conformance.errors import UsageError
from conformance.suite.checks import PROFILES
from conformance.suite.run import RunOptions, run, select_shard

CHECKS = ("mid-block-hits", "chunked-prefill", "snapshot-reuse")  # three: shard 1/2 gets two


def test_shards_partition_the_checks():
    planned = list(enumerate(PROFILES["standard"].checks))
    for n in (1, 2, 3, 4, 7):
        shards = [select_shard(planned, i, n) for i in range(1, n + 1)]
        flat = sorted(i for s in shards for i, _ in s)
        assert flat == list(range(len(planned)))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(UsageError):
        select_shard(planned, 0, 2)
    with pytest.raises(UsageError):
        select_shard(planned, 3, 2)


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_bad_shard_is_a_usage_error(bad, capsys):
    assert cli(["run", "--shard", bad, "--report-dir", "/nonexistent/never-written"]) == 2
    assert "--shard" in capsys.readouterr().err


def test_an_empty_shard_is_a_usage_error(tmp_path, capsys):
    """--shard 4/4 of three checks would run nothing and end green: refused (exit 2), nothing written."""
    argv = ["run", "--check", CHECKS[0], "--check", CHECKS[1], "--check", CHECKS[2], "--shard", "4/4",
            "--report-dir", str(tmp_path / "r")]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "this shard holds no check" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def _summary(result, exact=True):
    return [(c.id, c.status, c.examples, c.operations) if exact else (c.id, c.failure and c.failure.kind)
            for c in result.checks]


def test_workers_and_shards_give_the_serial_results(tmp_path):
    opts = dict(checks=CHECKS, examples=2, steps=3)
    serial = run(RunOptions(**opts, report_dir=tmp_path / "serial"))
    parallel = run(RunOptions(**opts, workers=2, report_dir=tmp_path / "parallel"))
    assert _summary(parallel) == _summary(serial)
    assert parallel.metrics["workers"] == 2 and (tmp_path / "parallel" / "results.json").exists()
    shards = [run(RunOptions(**opts, shard=(i, 2), write_reports=False)) for i in (1, 2)]
    merged = sorted(c for s in shards for c in _summary(s))
    assert merged == sorted(_summary(serial))
    assert [c.id for c in shards[0].checks] == ["mid-block-hits", "snapshot-reuse"]


def test_merging_shards_gives_one_report(tmp_path):
    from conformance.suite.merge import main as merge_main

    opts = dict(checks=CHECKS, examples=2, steps=3)
    for i in (1, 2):
        run(RunOptions(**opts, shard=(i, 2), report_dir=tmp_path / f"shard-{i}"))
    code = merge_main([str(tmp_path / "all"), str(tmp_path / "shard-1"), str(tmp_path / "shard-2")])
    import json

    doc = json.loads((tmp_path / "all" / "results.json").read_text())
    # the exit status is the merged verdict: 0 exactly when every check of every shard passed
    assert code == (0 if all(c["status"] == "passed" for c in doc["checks"]) else 1)
    assert doc["summary"]["ok"] is (code == 0)
    assert [c["id"] for c in doc["checks"]] == list(CHECKS)
    assert (tmp_path / "all" / "junit.xml").exists() and (tmp_path / "all" / "index.html").exists()
    # the same shard twice is refused (exit 2), not double counted
    assert merge_main([str(tmp_path / "bad"), str(tmp_path / "shard-1"), str(tmp_path / "shard-1")]) == 2


def test_one_check_draws_what_it_draws_in_the_whole_run():
    """``--check X`` seeds X by its position in the profile, not in the
    ``--check`` list: narrowing a run to the failing check draws its examples."""
    both = run(RunOptions(checks=["mid-block-hits", "snapshot-reuse"], examples=3, steps=4, write_reports=False))
    alone = run(RunOptions(checks=["snapshot-reuse"], examples=3, steps=4, write_reports=False))
    assert alone.checks[0].coverage == both.checks[1].coverage
    assert alone.checks[0].operations == both.checks[1].operations
