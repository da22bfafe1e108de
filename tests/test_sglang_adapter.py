"""SGLang 0.5.23's own hybrid radix cache (``--impl sglang``) through the
harness: hand-written sequences give the no-cache logits with a consistent
view in each configuration, each SGLang mutant is caught by the general suite
with a short repro that ``replay`` reproduces.

Runs in the SGLang virtualenv (``bash scripts/install_sglang.sh .venvs/sglang``;
``scripts/test.sh`` runs this file with it); elsewhere it skips and says why.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang not installed: bash scripts/install_sglang.sh .venvs/sglang, then run this file with "
                ".venvs/sglang/bin/python -m pytest", allow_module_level=True)

from drive import apply_all, session_of  # noqa: E402

from conformance.adapters.sglang import SglangCache  # noqa: E402
from conformance.adapters.sglang.config import SglangOptions  # noqa: E402
from conformance.contract import ImplConfig, Layout  # noqa: E402
from conformance.harness.ops import Abort, Drain, Step, Submit  # noqa: E402
from fault_injection.sglang_mutants import SGLANG_MUTANTS  # noqa: E402

SHARED = tuple(range(1, 12))
CONFIGS = {
    "no_buffer-python": {},
    "no_buffer-rust": {"tree_core": "rust"},
    "extra_buffer-python": {"page_size": 4, "track_interval": 4},
    "extra_buffer-rust": {"page_size": 4, "tree_core": "rust"},
}


def make(model, oracle, num_blocks=64, **options):
    impl = SglangCache(ImplConfig(block_size=4, num_kv_blocks=num_blocks, num_state_slots=24, options=options))
    return session_of(impl, model, oracle)


def test_contract_basics(model, oracle):
    import sglang

    s = make(model, oracle)
    assert (s.impl.name, s.impl.version) == ("sglang", sglang.__version__)
    assert s.impl.layout() == Layout(1, 257, 25)  # page 0 and Mamba slot 0 are never handed out
    assert make(model, oracle, page_size=4).impl.layout() == Layout(4, 65, 25)


def test_options_are_validated():
    with pytest.raises(ValueError, match="page_size=1"):
        SglangOptions.from_config(ImplConfig(options={"mode": "no_buffer", "page_size": 4}))
    with pytest.raises(ValueError, match="unknown"):
        SglangOptions.from_config(ImplConfig(options={"no_such_knob": 1}))
    with pytest.raises(ValueError, match="multiple"):
        SglangOptions.from_config(ImplConfig(options={"page_size": 4, "track_interval": 6}))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_shared_prefixes_chunks_decode_and_aborts(model, oracle, config):
    """Shared prefixes (copy-on-write from tree states), chunked prefills,
    decode past a track boundary, an abort mid-prefill and a multi-turn
    continuation: logits equal the no-cache reference, the view holds."""
    s = make(model, oracle, **CONFIGS[config])
    apply_all(s, [Submit("a", SHARED + (20, 21, 22, 23, 24), 6), Drain(64)])
    turn = s.tracks["a"].tokens
    # SGLang caches a state where a prefill chunk or a sequence ends (no_buffer) or
    # on the track grid (extra_buffer): both hold one at a's prompt end, 16.
    prompt = SHARED + (20, 21, 22, 23, 24)
    ops = [Submit("b", prompt + (25, 26), 3), Submit("c", tuple(range(30, 47)), 2),
           Submit("x", prompt + (40, 41, 42, 43, 44, 45, 46), 2), Step(4), Abort("x"), Step(8),
           Submit("t", turn + (50, 51, 52), 2, continues="a"), Drain(5)]
    apply_all(s, ops)
    assert s.coverage["prefix_hits"] >= 2 and s.coverage["chunked_prefills"] > 0, s.coverage
    assert s.coverage["multi_turn_hits"] >= 1 and s.coverage["aborts"] == 1, s.coverage


def test_eviction_under_pressure(model, oracle):
    """A 24-token pool: distinct prompts evict cached prefixes (tombstoned
    states on internal nodes, leaves deleted) while later requests reuse what
    survives; nothing leaks."""
    s = make(model, oracle, num_blocks=6)
    ops = []
    for i in range(6):
        ops += [Submit(f"p{i}", tuple(range(10 * i, 10 * i + 9)), 2), Drain(8)]
        ops += [Submit(f"q{i}", tuple(range(10 * i, 10 * i + 9)) + (63,), 1), Drain(8)]
    apply_all(s, ops)
    assert s.coverage["evictions"] > 0 and s.coverage["prefix_hits"] > 0, s.coverage


def test_mutants_are_documented_and_registered():
    from fault_injection.catalog import all_mutants

    MUTANTS = all_mutants()
    for name, apply in SGLANG_MUTANTS.items():
        assert apply.__doc__ and len(apply.__doc__) > 40, name
        assert MUTANTS[name].target == "sglang"


@pytest.mark.parametrize("mutant", sorted(SGLANG_MUTANTS))
def test_general_suite_catches_every_sglang_mutant(mutant, tmp_path):
    """The mutants self-check, as ``hybrid-conformance mutants --impl sglang``
    runs it: the first check of the profile, with the options each mutant's
    code path needs, catches it (invariant or logits, never SGLang's own
    crash), and the repro it writes (<= 8 operations) replays the failure."""
    import json

    from conformance.cli.cmd_mutants import run_mutant
    from conformance.results.repro import load
    from conformance.suite.options import RunOptions
    from conformance.suite.replay import replay
    from fault_injection.catalog import get_mutant

    entry = run_mutant(get_mutant(mutant), RunOptions(impl="sglang", checks=("mid-block-hits",)), tmp_path / mutant)
    assert entry["detected"], entry["not_detections"]
    assert entry["kind"] in ("logits", "invariant") and entry["repro_steps"] <= 8, entry
    repro = json.loads(open(entry["repro"]).read())
    assert repro["impl"] == "sglang" and repro["mutant"] == mutant
    assert replay(load(entry["repro"])).reproduced
