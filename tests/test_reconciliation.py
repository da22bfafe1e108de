"""The design note's four tier reconciliation cases (local longer, remote
longer, a tie, a local hit ending inside a block against a remote block
boundary): each scenario's request reuses the expected number of tokens from
the expected tier, on the reference (and on vLLM's connector where its
configuration is given), with the expected-hit oracle judging the replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.model import ModelConfig, TinyHybrid
from conformance.results.repro import load
from conformance.suite.replay import replay

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"
CASES = sorted(p for p in SCENARIO_DIR.glob("*.json") if "expect" in json.loads(p.read_text()))


@pytest.fixture(scope="module")
def tiny():
    return TinyHybrid(ModelConfig())


def test_the_four_cases_are_there():
    winners = {(json.loads(p.read_text())["expect"]["winner"], p.stem) for p in CASES}
    assert len(CASES) >= 4 and {w for w, _ in winners} == {"local", "remote"}


def _outcome(events: list[dict], rid: str) -> tuple[int | None, bool]:
    """The request's first start and whether it loaded anything."""
    start, loaded = None, False
    for ev in events:
        if ev.get("event") != "plan":
            continue
        loaded |= any(t["request_id"] == rid and t["direction"] == "load" for t in ev.get("transfers", ()))
        for r in ev["requests"]:
            if r["request_id"] == rid and start is None:
                start = r["start"]
    return start, loaded


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_reconciliation_case_on_the_reference(path, tiny):
    repro = load(path)
    expect = json.loads(path.read_text())["expect"]
    out = replay(repro, cli_mutant="none", model=tiny, keep_events=True)
    assert not out.reproduced, f"{path.name}: {out.kind}: {out.message}"
    start, loaded = _outcome(out.events, expect["request"])
    assert start == expect["reuse"], f"{expect['request']} reused {start}, expected {expect['reuse']}"
    assert loaded == (expect["winner"] == "remote"), f"winner: expected {expect['winner']}, loads issued: {loaded}"
