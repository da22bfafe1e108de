"""The design note's four tier reconciliation cases (local longer, remote
longer, a tie, a local hit ending inside a block against a remote block
boundary): each scenario's request reuses the expected number of tokens from
the expected tier, on the reference (and on vLLM's connector where its
configuration is given), with the expected-hit oracle judging the replay."""

from __future__ import annotations

import dataclasses
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
    _assert_outcome(out.events, expect)


def _assert_outcome(events: list[dict], expect: dict) -> None:
    start, loaded = _outcome(events, expect["request"])
    assert start == expect["reuse"], f"{expect['request']} reused {start}, expected {expect['reuse']}"
    assert loaded == (expect["winner"] == "remote"), f"winner: expected {expect['winner']}, loads issued: {loaded}"


VLLM_CASES = [p for p in CASES if "vllm" in json.loads(p.read_text())]


def test_every_case_has_a_vllm_configuration():
    assert VLLM_CASES == CASES


@pytest.mark.parametrize("path", VLLM_CASES, ids=[p.stem for p in VLLM_CASES])
def test_reconciliation_case_on_vllm(path, tiny):
    """The same operations on vLLM's scheduler with the store connector
    (``vllm`` in the file: options, pool size, and the expected winner and
    reuse where vLLM's own semantics give other values, with the reason):
    the winner and the reuse are read from the plans, as on the reference,
    and the replay must pass (logits, invariants, the expected-hit oracle)."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    doc = json.loads(path.read_text())
    cfg = doc["vllm"]
    expect = {**doc["expect"], **cfg.get("expect", {})}
    repro = load(path)
    impl_config = dataclasses.replace(repro.impl_config, num_kv_blocks=cfg["num_kv_blocks"],
                                      num_state_slots=cfg["num_kv_blocks"], options=cfg["options"])
    out = replay(dataclasses.replace(repro, impl_config=impl_config), cli_impl="vllm", cli_mutant="none",
                 model=tiny, keep_events=True)
    assert not out.reproduced, f"{path.name} on vLLM: {out.kind}: {out.message}"
    _assert_outcome(out.events, expect)
    if expect["winner"] == "remote":  # the loads landed whole (the connector reported them, vLLM resumed)
        done = [ev for ev in out.events if ev.get("event") == "transfer-done"]
        assert done and all(ev["ok"] for ev in done)
