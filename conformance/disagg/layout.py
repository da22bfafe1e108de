"""What a disaggregated implementation asks the harness to allocate: each
worker's layout (:class:`WorkerLayout`), the pair (:class:`DisaggLayouts`).
The geometry of those pages (:mod:`.geometry`) and the rest of the contract
(:mod:`.contract`) build on it."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"
WORKERS = (PREFILL, DECODE)
STATE_DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class WorkerLayout:
    """One worker's memory.  Every physical page can serve as one KV block or
    one state slot (engines share one page pool between the two views, so a
    page's padding and stale bytes may come from either)."""

    worker: str  # PREFILL or DECODE
    block_size: int  # tokens per KV block on this worker
    num_pages: int
    # Tensor-parallel stand-in: the recurrent heads are split over this many
    # shards; each shard keeps its conv state split by parts (q, k, v; Mamba's
    # C, B, x) and its matrix state by heads.
    state_shards: int = 1
    state_dtype: str = "float64"

    def __post_init__(self) -> None:
        if self.worker not in WORKERS:
            raise ValueError(f"worker must be one of {WORKERS}, got {self.worker!r}")
        if self.block_size < 1 or self.num_pages < 1 or self.state_shards < 1:
            raise ValueError(f"layout values must be positive: {self}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")


@dataclass(frozen=True)
class DisaggLayouts:
    prefill: WorkerLayout
    decode: WorkerLayout

    def of(self, worker: str) -> WorkerLayout:
        return self.prefill if worker == PREFILL else self.decode
