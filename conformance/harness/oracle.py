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
        # Each run's logits, and for every prefix the run and the row that hold its
        # logits (the first run that covered it).  Two ints a prefix, not a tensor
        # view: a quick profile keeps ~10^5 prefixes, and views were as many
        # objects for the cyclic garbage collector to walk at each full collection.
        self._runs: list[torch.Tensor] = []
        self._rows: dict[Prefix, tuple[int, int]] = {}
        self.reference_runs = 0

    def prime(self, tokens: Prefix) -> None:
        """Compute (once) the reference of a whole sequence, storing every prefix's row."""
        if tokens and tokens not in self._rows:
            run = len(self._runs)
            self._runs.append(self.model.reference(tokens))
            self.reference_runs += 1
            for i in range(len(tokens)):
                self._rows.setdefault(tokens[: i + 1], (run, i))

    def _row(self, prefix: Prefix) -> torch.Tensor:
        run, i = self._rows[prefix]
        return self._runs[run][i]

    def rows(self, tokens: Prefix, start: int, end: int) -> torch.Tensor:
        if tokens[:end] not in self._rows:
            self.prime(tokens[:end])
        where = [self._rows[tokens[: i + 1]] for i in range(start, end)]
        if where and all(w == (where[0][0], where[0][1] + k) for k, w in enumerate(where)):
            # one run's consecutive rows (the common case): its slice, the same values as their stack
            run, first = where[0]
            return self._runs[run][first: first + len(where)]
        return torch.stack([self._runs[run][i] for run, i in where])

    def next_token(self, tokens: Prefix) -> int:
        """Greedy next token after ``tokens``, from the reference (so a sequence
        depends on its tokens only, never on the implementation under test)."""
        if tokens not in self._rows:
            self.prime(tokens)
        return int(self._row(tokens).argmax())

    @torch.inference_mode()  # (no autograd bookkeeping: see Runner.execute)
    def judge(self, tokens: Prefix, start: int, logits: torch.Tensor) -> Verdict:
        ref = self.rows(tokens, start, start + logits.shape[0])
        got = logits.to(ref.dtype)
        scale = ref.abs().max().clamp_min(1.0)
        err = (got - ref).abs().amax(dim=-1) / scale
        err = err.masked_fill_(err.isnan(), float("inf"))  # a NaN logit is as wrong as can be
        # One reduction decides: no NaN is left, so nothing exceeds the tolerance
        # when the largest error does not (the first bad row is looked up only then).
        worst = float(err.max())
        first = None if worst <= self.tolerance else start + int((err > self.tolerance).nonzero()[0, 0])
        return Verdict(ok=first is None, max_rel_error=worst, first_bad_position=first)
