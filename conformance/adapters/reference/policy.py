"""Retention policy: at which positions a request's recurrent state is kept.

``interval`` None keeps a checkpoint at every block boundary (dense); I > 0
every I tokens (a multiple of the block size); 0 prompt ends only.  Prompt ends
are always checkpoints: the next turn of a conversation replays the prompt.
The end of a finished request's sequence is offered too (the next turn
replays the output as well).

``admission`` decides whether a reached checkpoint is actually stored:
"always" stores every one; "second-hit" (Marconi) stores a prefix's state only
from its second sighting on -- the first proves the prefix exists, the second
that it is shared.  A *sighting* is one request computing through the
checkpoint (reaching it by computation, not by reusing it), counted once per
request and position.  Under second-hit, a prefix some request offered is a
checkpoint for every later request that computes through it: that is how a
shared prefix gets its second sighting (Marconi's branch points, restricted to
positions the policy would keep for someone).
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("always", "second-hit")


@dataclass(frozen=True)
class RetentionPolicy:
    interval: int | None = None
    admission: str = "always"  # "always" | "second-hit"

    @classmethod
    def from_options(cls, options: dict, block_size: int) -> RetentionPolicy:
        interval = options.get("interval")
        if interval is not None and (not isinstance(interval, int) or interval < 0):
            raise ValueError(f"retention interval must be None or an integer >= 0, got {interval!r}")
        if interval is not None and interval % block_size:
            raise ValueError(f"retention interval {interval} is not a multiple of the block size {block_size}")
        admission = options.get("admission", "always")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission policy {admission!r}")
        return cls(interval=interval, admission=admission)

    def is_checkpoint(self, pos: int, prompt_len: int, block_size: int) -> bool:
        if pos == prompt_len:
            return True
        step = block_size if self.interval is None else self.interval
        return step > 0 and pos % step == 0

    def next_checkpoint(self, after: int, prompt_len: int, block_size: int) -> int | None:
        """The first checkpoint strictly after ``after`` (chunks are cut there)."""
        step = block_size if self.interval is None else self.interval
        candidates = [prompt_len] if prompt_len > after else []
        if step > 0:
            candidates.append((after // step + 1) * step)
        return min(candidates) if candidates else None

    def declaration(self, block_size: int) -> dict:
        """The policy as plain data, for ``CacheImplementation.retention()``."""
        return {"interval": self.interval, "admission": self.admission, "block_size": block_size,
                "prompt_ends": True, "sequence_ends": True}


class Sightings:
    """How many requests computed through each checkpoint prefix.

    Kept for every offered prefix, admitted or not, for the life of the cache:
    a prefix evicted after its second sighting is readmitted on the third.
    Exact token tuples, not hashes: a collision would admit on a first sighting."""

    def __init__(self):
        self.counts: dict[tuple[int, ...], int] = {}

    def see(self, prefix: tuple[int, ...]) -> int:
        n = self.counts.get(prefix, 0) + 1
        self.counts[prefix] = n
        return n
