"""What an engine-level adapter offers the engine checks.

At this level a whole engine runs its own kernels and its own cache; the
harness only sends requests and compares what comes back.  So the protocol is
small: submit a batch of token prompts (one ``generate`` call, so the engine
may schedule them together), get back per request the generated token ids, the
logprob of each generated token, and how many prompt tokens the engine served
from its prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class EngineOutput:
    tokens: tuple[int, ...]  # generated token ids (greedy)
    logprobs: tuple[float, ...]  # logprob of each generated token, same length
    cached_tokens: int  # prompt tokens served from the prefix cache (0: a miss)


@dataclass
class EngineInfo:
    name: str
    version: str
    block_size: int  # the attention block size the engine really uses
    prefix_caching: bool
    extra: dict = field(default_factory=dict)


@runtime_checkable
class EngineAdapter(Protocol):
    info: EngineInfo

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[EngineOutput]:
        """Greedy decoding of ``max_tokens`` tokens (EOS ignored) for each prompt,
        all submitted at once.  Raises :class:`EngineError`."""
        ...

    def restart(self) -> None:
        """Make the adapter usable again after an :class:`EngineError` (a new engine, empty cache)."""
        ...

    def close(self) -> None:
        ...
