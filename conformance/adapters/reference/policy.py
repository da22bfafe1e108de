"""Retention policy: at which positions a request's recurrent state is kept.

``interval`` None keeps a checkpoint at every block boundary (dense); I > 0
every I tokens (a multiple of the block size); 0 prompt ends only.  Prompt ends
are always checkpoints: the next turn of a conversation replays the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPolicy:
    interval: int | None = None
    admission: str = "always"  # "always" | "second-hit"

    @classmethod
    def from_options(cls, options: dict, block_size: int) -> "RetentionPolicy":
        interval = options.get("interval")
        if interval is not None and interval % block_size:
            raise ValueError(f"retention interval {interval} is not a multiple of the block size {block_size}")
        admission = options.get("admission", "always")
        if admission not in ("always", "second-hit"):
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
