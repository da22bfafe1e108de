"""The no-cache oracle's memo and verdicts (conformance/harness/oracle.py): a prefix's row is the
first run's that covered it, whichever path (one run's slice, or rows of several runs) serves it."""

from __future__ import annotations

import torch

from conformance.harness.oracle import Oracle
from conformance.model import ModelConfig, TinyHybrid

MODEL = TinyHybrid(ModelConfig())
P = (3, 1, 4, 1, 5, 9, 2, 6)
Q = P + (5, 3, 5)


def test_rows_are_the_first_runs_rows():
    oracle = Oracle(MODEL)
    oracle.prime(P)
    ref_p, ref_q = MODEL.reference(P), MODEL.reference(Q)
    assert torch.equal(oracle.rows(P, 2, 6), ref_p[2:6])  # one run's consecutive rows
    # Q's first rows were P's run's, its last ones its own run's: served as a stack of both
    assert torch.equal(oracle.rows(Q, 5, 11), torch.cat([ref_p[5:8], ref_q[8:11]]))
    assert torch.equal(oracle.rows(Q, 9, 10), ref_q[9:10])
    assert oracle.reference_runs == 2
    assert oracle.next_token(Q) == int(ref_q[-1].argmax())
    assert oracle.next_token(P[:3]) == int(ref_p[2].argmax())  # held: no run
    assert oracle.reference_runs == 2


def test_judge_finds_the_first_bad_row():
    oracle = Oracle(MODEL)
    ref = MODEL.reference(P)
    ok = oracle.judge(P, 0, ref.clone())
    assert ok.ok and ok.max_rel_error == 0.0 and ok.first_bad_position is None
    off = ref[3:].clone()
    off[2, 0] += 1e-3 * ref[3:].abs().max().clamp_min(1.0)  # position 5, 1e-3 of the judged rows' scale
    bad = oracle.judge(P, 3, off)
    assert not bad.ok and bad.first_bad_position == 5 and 0.5e-3 < bad.max_rel_error < 2e-3
    nan = ref[1:].clone()
    nan[4, 7] = float("nan")  # position 5: as wrong as can be
    worst = oracle.judge(P, 1, nan)
    assert not worst.ok and worst.first_bad_position == 5 and worst.max_rel_error == float("inf")
