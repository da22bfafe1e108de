"""The no-cache oracle: reference logits of from-scratch runs, memoized by
token prefix (a from-scratch run of a sequence never changes, and causality
makes the logits at position i a function of tokens[:i+1] alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.harness.memory import Prefix
from conformance.model import TinyHybrid

# Calibrated tolerances: relative to the largest reference logit.  float64 on a
# CPU agrees to ~1e-15; a wrong state or KV moves logits by >= 1e-3.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class Verdict:
    ok: bool
    max_rel_error: float
    first_bad_position: int | None


class Oracle:
    def __init__(self, model: TinyHybrid, tolerance: float | None = None):
        self.model = model
        self.tolerance = TOLERANCE.get(model.dtype, 1e-4) if tolerance is None else tolerance
        self._rows: dict[Prefix, torch.Tensor] = {}
        self.reference_runs = 0

    def prime(self, tokens: Prefix) -> None:
        """Compute (once) the reference of a whole sequence, storing every prefix's row."""
        if tokens and tokens not in self._rows:
            logits = self.model.reference(tokens)
            self.reference_runs += 1
            for i in range(len(tokens)):
                self._rows.setdefault(tokens[: i + 1], logits[i])

    def rows(self, tokens: Prefix, start: int, end: int) -> torch.Tensor:
        if tokens[:end] not in self._rows:
            self.prime(tokens[:end])
        return torch.stack([self._rows[tokens[: i + 1]] for i in range(start, end)])

    def next_token(self, tokens: Prefix) -> int:
        """Greedy next token after ``tokens``, from the reference (so a sequence
        depends on its tokens only, never on the implementation under test)."""
        return int(self.rows(tokens, len(tokens) - 1, len(tokens))[0].argmax())

    @torch.inference_mode()  # (no autograd bookkeeping: see Runner.execute)
    def judge(self, tokens: Prefix, start: int, logits: torch.Tensor) -> Verdict:
        ref = self.rows(tokens, start, start + logits.shape[0])
        got = logits.to(ref.dtype)
        scale = ref.abs().max().clamp_min(1.0)
        err = (got - ref).abs().amax(dim=-1) / scale
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        bad = (err > self.tolerance).nonzero()
        first = None if bad.numel() == 0 else start + int(bad[0, 0])
        return Verdict(ok=first is None, max_rel_error=float(err.max()), first_bad_position=first)
