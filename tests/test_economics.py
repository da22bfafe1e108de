"""Cache economics from real replays (design note, section 3) and the cost
model (sections 1-2), plus the economics command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conformance.adapters.reference import ReferenceCache
from conformance.analysis.cost_model import NOTE_KV_BYTES_PER_TOKEN, NOTE_STATE_BYTES, CostModel, sizes_of
from conformance.analysis.economics import replay_workload
from conformance.cli.main import main
from conformance.generate import workload as wl
from conformance.model import ModelConfig

torch.set_num_threads(1)


def _requests(lines):
    known: set[str] = set()
    out = []
    for i, d in enumerate(lines):
        out.append(wl.parse(d, f"gen:{i}", wl.VOCAB, known))
        known.add(out[-1].id)
    return out


def _figures(requests, admission):
    r = replay_workload(requests, ReferenceCache, {"admission": admission}).result
    assert r["evictions"] == 0  # the figures are about admission, not capacity
    return r["entries_stored"], r["hits"], r["hits_per_entry"]


def test_heavy_tail_scaled_down():
    """The section 3 workload at a tenth of the size: 80 one-off prefixes, 4 hot ones sighted 12 times."""
    reqs = _requests(wl.heavy_tail(n_oneoff=80, n_hot=4, repeats=12))
    assert _figures(reqs, "always") == (84, 44, round(44 / 84, 4))
    assert _figures(reqs, "second-hit") == (4, 40, 10.0)


def test_flat_reuse_defeats_second_hit():
    reqs = _requests(wl.flat(n=20, k=2))
    assert _figures(reqs, "always") == (20, 20, 1.0)
    entries, hits, _ = _figures(reqs, "second-hit")
    assert (entries, hits) == (20, 0)  # admitted on the second sighting; no third ever comes


@pytest.mark.slow
def test_bundled_heavy_tail_reproduces_the_design_note():
    reqs = wl.load("heavy-tail")
    entries, hits, per = _figures(reqs, "always")
    assert (entries, hits, f"{per:.2f}") == (840, 440, "0.52")
    entries, hits, per = _figures(reqs, "second-hit")
    assert (entries, hits, f"{per:.2f}") == (40, 400, "10.00")


@pytest.mark.slow
def test_bundled_flat_k2_second_hit_collects_nothing():
    assert _figures(wl.load("flat-k2"), "second-hit")[1] == 0


def test_agent_sessions_reuse_prompt_ends_with_interval_zero():
    reqs = wl.load("agent-sessions")[:32]  # two turns of every session
    r = replay_workload(reqs, ReferenceCache, {"interval": 0}).result
    assert r["hits"] == 16  # every second turn resumes from the first turn's state
    # the shared system prompt is served from the KV but has no state at its end with I = 0
    assert r["kv_hit_rate"] > r["state_hit_rate"] and r["recomputed_no_state_tokens"] > 0


def test_cost_model_matches_the_design_note():
    m = CostModel(NOTE_STATE_BYTES, NOTE_KV_BYTES_PER_TOKEN)
    assert m.crossover_tokens() == 3072
    assert round(m.optimal_interval()) == 2508
    grid = [1_000 + i * 100 for i in range(4_000)]
    best = min(grid, key=m.total_cost)
    assert abs(best - m.optimal_interval()) / m.optimal_interval() < 0.02  # closed form = grid search
    cheap = CostModel(NOTE_STATE_BYTES, NOTE_KV_BYTES_PER_TOKEN, beta=1e-5)
    assert math.isclose(cheap.optimal_interval() / m.optimal_interval(), 10.0)  # sqrt(1/beta)
    assert m.plan(4096)["expected_recompute_tokens"] == 2048


def test_sizes_of_a_model_config():
    c = ModelConfig()
    state, kv = sizes_of(c, dtype_bytes=2)
    assert kv == c.num_attn_layers * 2 * c.attn_heads * c.head_dim * 2
    assert state == c.num_rec_layers * ((c.conv_width - 1) * c.conv_channels
                                        + c.rec_heads * c.rec_key_dim * c.rec_value_dim) * 2


def test_command_cost_model_json(capsys):
    assert main(["economics", "--state-bytes", str(3 * 2**20), "--kv-bytes-per-token", "1024",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)["cost_model"]
    assert out["crossover_tokens"] == 3072 and round(out["optimal_interval"]) == 2508


def test_command_replays_a_workload_file(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    lines = [{"id": "a", "prompt": [1, 2, 3, 4, 5], "prefix_len": 4}, {"id": "b", "prompt": [1, 2, 3, 4, 6],
             "prefix_len": 4}, {"id": "c", "continues": "b", "append": [9], "max_new_tokens": 2}]
    path.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    assert main(["economics", "--workload", str(path), "--format", "json", "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("entries_stored", "hits", "hits_per_entry", "kv_hit_rate", "state_hit_rate",
                "recomputed_no_state_tokens", "state_occupancy_mean", "kv_occupancy_mean"):
        assert key in out
    assert (out["entries_stored"], out["hits"]) == (1, 1)
    # matplotlib is a test dependency (pyproject's "test" extra): the plot must be there, a real PNG
    assert out["plot"] == str(tmp_path / "p.png"), "no plot written (is matplotlib installed? it is in .[test])"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_usage_errors(tmp_path):
    assert main(["economics"]) == 2
    assert main(["economics", "--workload", "no-such-workload"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1, 2], "colour": "red"}\n')
    assert main(["economics", "--workload", str(bad)]) == 2
    assert main(["economics", "--state-bytes", "100"]) == 2


def test_the_state_hit_rate_under_spec_decode():
    """Multi-turn sessions replayed with drafts verified at every decode step
    (issue 22): the reference keeps caching at accepted boundaries, so the
    state hit rate under spec decode is the one without it; a cache that
    publishes nothing while it speculates (vllm#54360: 0 hits on GDN under any
    speculative method) shows a collapsed state hit rate beside its KV hit rate.
    A turn that ends inside a verification (the drafter proposes past a
    request's last token, issue 37) has computed its last token, which a
    plain decode never computes: the next turn reuses that one token more."""
    reqs = wl.load("agent-sessions")[:32]
    plain = replay_workload(reqs, ReferenceCache, {"interval": 0}).result
    spec = replay_workload(reqs, ReferenceCache, {"interval": 0}, spec=(3, 1)).result
    sp = spec["speculation"]
    assert sp["verify_steps"] > 0 and 0 < sp["accepted"] < sp["drafts"]
    assert spec["hits"] == plain["hits"] and plain["state_hit_rate"] <= spec["state_hit_rate"] < 1.1 * \
        plain["state_hit_rate"]

    class NoStatesWhileSpeculating(ReferenceCache):
        def _register_snapshot(self, req):
            if not self.spec.tokens:
                super()._register_snapshot(req)

    broken = replay_workload(reqs, NoStatesWhileSpeculating, {"interval": 0}, spec=(3, 1)).result
    assert broken["state_hit_rate"] < spec["state_hit_rate"] and broken["kv_hit_rate"] > broken["state_hit_rate"]


def test_command_speculative_usage_errors(capsys):
    assert main(["economics", "--workload", "agent-sessions", "--spec-agree", "1"]) == 2
    assert main(["economics", "--workload", "agent-sessions", "--spec-tokens", "-1"]) == 2
    assert "--spec-agree needs --spec-tokens" in capsys.readouterr().err
