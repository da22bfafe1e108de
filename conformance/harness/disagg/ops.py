"""Operations of a disaggregated scenario: what a state machine (or a repro
file) does to a :class:`~.session.DisaggSession`.  Plain frozen dataclasses,
named apart from the single-worker operations of :mod:`conformance.harness.ops`
(they take other fields); a repro is a short list of them plus the layout
pairing and the transport.  In repro files they are ``disagg-submit``,
``disagg-step``, ``disagg-drain``, ``disagg-abort`` and ``disagg-fault``
(:data:`OP_TYPES`); ``conformance.harness.ops.op_from_dict`` validates their
fields as it does the single-worker ones'."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .faults import FAULT_KINDS


@dataclass(frozen=True)
class DisaggSubmit:
    """Add a request of ``prompt_len`` tokens (deterministic, :func:`prompt_for`)."""

    request_id: str
    prompt_len: int
    shared: int = 0  # tokens taken from the scenario's shared prefix (prefill-side prefix hits)
    max_new: int = 3


@dataclass(frozen=True)
class DisaggStep:
    """``count`` engine steps over both workers."""

    count: int = 1


@dataclass(frozen=True)
class DisaggDrain:
    """Steps until every request finished and no transfer is in flight, then
    the checkers judge the implementation at rest (nothing held)."""


@dataclass(frozen=True)
class DisaggAbort:
    request_id: str


@dataclass(frozen=True)
class DisaggArmFault:
    """The environment fails the next transfer submitted (a peer restart, a lost notification...)."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in ARMABLE:
            raise ValueError(f"kind: {self.kind!r} cannot be armed mid-run (armable: {', '.join(ARMABLE)})")


DisaggOp = DisaggSubmit | DisaggStep | DisaggDrain | DisaggAbort | DisaggArmFault

# The faults a scenario can arm mid-run (the dtype mismatch fires at the metadata exchange only).
ARMABLE = tuple(k for k in FAULT_KINDS if k != "dtype-mismatch")


def prompt_for(op: DisaggSubmit, seed: int, shared_prefix: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """Deterministic tokens: the shared prefix's first ``shared`` tokens, then
    tokens seeded by the request id (so a repro replays the same prompts)."""
    rng = random.Random(f"{seed}:{op.request_id}")
    head = shared_prefix[: min(op.shared, op.prompt_len)]
    return head + tuple(rng.randrange(vocab) for _ in range(op.prompt_len - len(head)))


def prompt_shared(seed: int, vocab: int, length: int = 96) -> tuple[int, ...]:
    rng = random.Random(f"{seed}:shared")
    return tuple(rng.randrange(vocab) for _ in range(length))


# The layout pairings the family runs: prefill 16-token blocks and 2 state
# shards -> decode 32-token blocks and 1 shard, and the reverse.
# The first pulls (decode READs, as vLLM's NIXL connector), the second pushes (prefill WRITEs and
# notifies, as SGLang's and Mooncake's do), so both directions run in every check.
PAIRINGS = {
    "2to1": {"prefill_block": 16, "decode_block": 32, "prefill_shards": 2, "decode_shards": 1, "op": "READ"},
    "1to2": {"prefill_block": 32, "decode_block": 16, "prefill_shards": 1, "decode_shards": 2, "op": "WRITE"},
}

# A general scenario (not written for any one bug): boundary, one-off and
# mid-block prompt ends, a transfer whose peer dies mid-way, a prefill-side
# prefix hit, decode continuing while other transfers are in flight.
GENERAL = (DisaggSubmit("r0", 33, shared=33), DisaggStep(), DisaggSubmit("r1", 18), DisaggArmFault("kill-peer"),
           DisaggDrain(), DisaggSubmit("r2", 40, shared=40), DisaggSubmit("r3", 32), DisaggDrain())

# Names in repro files (conformance.harness.ops registers them).
OP_TYPES: dict[str, type] = {"disagg-submit": DisaggSubmit, "disagg-step": DisaggStep, "disagg-drain": DisaggDrain,
                             "disagg-abort": DisaggAbort, "disagg-fault": DisaggArmFault}


def is_disagg(op: object) -> bool:
    return type(op) in OP_TYPES.values()
