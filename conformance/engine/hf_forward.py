"""The plain-transformers reference: one forward pass over a whole sequence,
no cache of any kind, with the same weights the engine loads.

It is teacher-forced on the engine's own output: given a prompt and the tokens
the engine generated, it scores each generated token.  So a single near-tie
never derails the comparison (the sequence is the engine's, only the scores
are recomputed).  Needs ``torch`` and ``transformers`` in this process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TOPK = 5


@dataclass(frozen=True)
class Scored:
    """Reference scores of tokens[start:], each given everything before it."""

    chosen: tuple[float, ...]  # logprob of the token that is there
    top1: tuple[int, ...]  # the reference's argmax at that position
    top1_logprob: tuple[float, ...]
    rank: tuple[int, ...]  # rank of the token that is there (0 = argmax)

    def to_dict(self) -> dict:
        return {"chosen": list(self.chosen), "top1": list(self.top1),
                "top1_logprob": list(self.top1_logprob), "rank": list(self.rank)}

    @classmethod
    def from_dict(cls, d: dict) -> Scored:
        return cls(tuple(d["chosen"]), tuple(d["top1"]), tuple(d["top1_logprob"]), tuple(d["rank"]))


class TransformersForward:
    def __init__(self, model_dir: str | Path, compute_dtype: str = "float32", device: str = "cpu"):
        import torch
        import transformers

        self.torch = torch
        self.device = device
        # Weights are stored in the engine's dtype; computing in float32 keeps
        # the reference's own rounding well below the engine's.
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, compute_dtype)).to(device).eval()  # type: ignore[arg-type]
        self.runs = 0

    def log_probs(self, tokens: Sequence[int]):
        """[len(tokens), vocab] log-softmax of the next-token logits at every position."""
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        self.runs += 1
        return torch.log_softmax(logits, dim=-1).cpu()

    def score(self, tokens: Sequence[int], start: int) -> Scored:
        if not 1 <= start <= len(tokens):
            raise ValueError(f"start {start} outside [1, {len(tokens)}]")
        lp = self.log_probs(tokens)[start - 1: len(tokens) - 1]  # row i-1 predicts token i
        there = self.torch.tensor(list(tokens[start:]), dtype=self.torch.long)
        chosen = lp.gather(1, there[:, None])[:, 0]
        top = lp.max(dim=-1)
        rank = (lp > chosen[:, None]).sum(dim=-1)
        return Scored(tuple(float(x) for x in chosen), tuple(int(x) for x in top.indices),
                      tuple(float(x) for x in top.values), tuple(int(x) for x in rank))
