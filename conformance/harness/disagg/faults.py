"""Environment faults on the prefill -> decode transfer path.

They are options of a transport (``Transport(faults=...)``): the world
misbehaving around a correct implementation, which must survive each one
(right logits or a clear error, never wrong output reported as success).
Every firing is recorded (a :class:`~conformance.harness.history.FaultFired`
in the session's history) naming the transport, the transfer, the request and
the place, because a fault that never fired proves nothing.

- ``drop-descriptor``: one descriptor of a chunk is never posted.
- ``truncate-tail``: the last descriptor of the last chunk moves only half its bytes.
- ``corrupt-bytes``: bytes of one destination range are flipped after they landed.
- ``reorder-completions``: this transfer's notice is held back and delivered
  after a later transfer's.
- ``lose-notification``: the last chunk is posted without a notification
  (NIXL sends none for an empty message), so the receiver never hears of it.
- ``kill-peer``: the peer process is SIGKILLed after the first chunk; the
  next post raises NIXL's remote-disconnect error.  The transport then starts
  a new peer on the same (never cleared) memory.
- ``dtype-mismatch``: the prefill worker keeps its recurrent state in
  float32 while decode expects float64 (sglang#36371); fires at the metadata
  exchange, which reports each side's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_KINDS = ("drop-descriptor", "truncate-tail", "corrupt-bytes", "reorder-completions",
               "lose-notification", "kill-peer", "dtype-mismatch")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    transfer: int = 0  # fires on the transfer with this submission index (0 = the first)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown transfer fault {self.kind!r}; known: {', '.join(FAULT_KINDS)}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``kind`` or ``kind@N`` (fires on the N-th transfer, 0-based)."""
        kind, _, at = text.partition("@")
        try:
            return cls(kind, int(at) if at else 0)
        except ValueError as e:
            raise ValueError(f"bad transfer fault {text!r}: {e}") from None
