"""The upstream bug catalogue as regression tests: every scenario in
``fixtures/scenarios/`` fails on its mutant and passes on the clean reference.

A scenario is a repro file (docs/repro-format.md) written by hand: a minimal,
readable step sequence that reproduces one class of bug from
upstream-bugs.md, naming its upstream issues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.model import ModelConfig, TinyHybrid
from conformance.results.repro import load
from conformance.suite.replay import replay

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"
FILES = sorted(SCENARIO_DIR.glob("*.json"))


def _registered() -> set[str]:
    from fault_injection.catalog import all_mutants

    return set(all_mutants())


@pytest.fixture(scope="module")
def tiny():
    return TinyHybrid(ModelConfig())  # every scenario uses the default model (model: {})


def test_the_catalogue_is_there():
    assert len(FILES) >= 4, f"expected the bug catalogue in {SCENARIO_DIR}"
    docs = [json.loads(p.read_text()) for p in FILES]
    assert all(d.get("title") and d.get("upstream") and d.get("mutant") for d in docs)
    # one file per bug class and mutant: duplicates would hide a missing class
    assert len({d["mutant"] for d in docs}) == len(docs)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario_fails_on_its_mutant_and_passes_on_the_reference(path, tiny):
    repro = load(path)
    if repro.impl == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm] (the scenario runs "
                                           "vLLM's scheduler)")
    if repro.mutant not in _registered():
        pytest.skip(f"mutant {repro.mutant!r} is not registered in fault_injection yet")
    # A generous call timeout: building vLLM's scheduler on a loaded CI machine can take tens of
    # seconds, and a timeout here would be a wrong kind, not the bug.
    bad = replay(repro, model=tiny, timeout=300)
    assert bad.reproduced, f"{path.name}: {repro.mutant} not caught ({bad.applied} operations ran cleanly)"
    # Every scenario records the kind it fails with, and replays with exactly that kind: the
    # suite's own checkers (never the mutant's own crash: raised/timeout is not a detection).
    from conformance.cli.cmd_mutants import SUITE_DETECTION

    recorded = repro.failure.get("kind")
    assert recorded in SUITE_DETECTION, f"{path.name}: failure.kind {recorded!r} (record the kind it fails with)"
    assert bad.kind == recorded, (bad.kind, bad.message)
    clean = replay(repro, cli_mutant="none", model=tiny, timeout=300)
    assert not clean.reproduced, f"{path.name} fails on the clean reference: {clean.kind}: {clean.message}"
