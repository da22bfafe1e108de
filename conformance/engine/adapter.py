"""What an engine-level adapter hands the engine checks.

At this level a whole engine runs its own kernels and its own cache; the
harness only sends requests and compares what comes back.  So what comes back
is small: per request of a batch (one ``generate(prompts, max_tokens)`` call,
so the engine may schedule them together) the generated token ids, the
logprob of each generated token, and how many prompt tokens the engine served
from its prefix cache (:class:`EngineOutput`); and what the engine is
(:class:`EngineInfo`).  The engines (``vllm_engine.VllmEngine``,
``pd.PdEngine``) also offer ``restart()`` after an ``EngineError`` and
``close()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineOutput:
    tokens: tuple[int, ...]  # generated token ids (greedy)
    logprobs: tuple[float, ...]  # logprob of each generated token, same length
    cached_tokens: int  # prompt tokens served from the prefix cache (0: a miss)
    # With speculative decoding: per step that verified drafts, (tokens generated before it, drafts in it).
    drafts: tuple[tuple[int, int], ...] = ()

    def drafts_before(self, position: int) -> int:
        """Drafts verified in steps that could have produced generated token ``position`` or an earlier one."""
        return sum(n for before, n in self.drafts if before <= position)


@dataclass
class EngineInfo:
    name: str
    version: str
    block_size: int  # the attention block size the engine really uses
    prefix_caching: bool
    extra: dict = field(default_factory=dict)
