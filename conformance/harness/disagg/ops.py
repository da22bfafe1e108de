"""Operations of a disaggregated scenario: what a state machine (or a repro
file) does to a :class:`~.session.DisaggSession`.  Plain frozen dataclasses;
a repro is a short list of them plus the layout pairing and the transport."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .faults import FAULT_KINDS


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_len: int
    shared: int = 0  # tokens taken from the scenario's shared prefix (prefill-side prefix hits)
    max_new: int = 3


@dataclass(frozen=True)
class Step:
    count: int = 1


@dataclass(frozen=True)
class Drain:
    pass


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ArmFault:
    """The environment fails the next transfer submitted (a peer restart, a lost notification...)."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS or self.kind == "dtype-mismatch":
            raise ValueError(f"ArmFault: {self.kind!r} cannot be armed mid-run")


Op = Submit | Step | Drain | Abort | ArmFault

# The faults a scenario can arm mid-run (the dtype mismatch fires at the metadata exchange only).
ARMABLE = tuple(k for k in FAULT_KINDS if k != "dtype-mismatch")


def prompt_for(op: Submit, seed: int, shared_prefix: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """Deterministic tokens: the shared prefix's first ``shared`` tokens, then
    tokens seeded by the request id (so a repro replays the same prompts)."""
    rng = random.Random(f"{seed}:{op.request_id}")
    head = shared_prefix[: min(op.shared, op.prompt_len)]
    return head + tuple(rng.randrange(vocab) for _ in range(op.prompt_len - len(head)))


def apply(session, op: Op, seed: int = 0) -> None:
    if isinstance(op, Submit):
        shared = prompt_shared(seed, session.model.config.vocab_size)
        session.submit(op.request_id, prompt_for(op, seed, shared, session.model.config.vocab_size), op.max_new)
    elif isinstance(op, Step):
        for _ in range(op.count):
            session.step()
    elif isinstance(op, Drain):
        session.drain()
        session.check_no_leak()
    elif isinstance(op, Abort):
        session.abort(op.request_id)
    elif isinstance(op, ArmFault):
        session.workers.transport.arm(op.kind)
    else:
        raise TypeError(f"unknown op {op!r}")


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
GENERAL = (Submit("r0", 33, shared=33), Step(), Submit("r1", 18), ArmFault("kill-peer"), Drain(),
           Submit("r2", 40, shared=40), Submit("r3", 32), Drain())

# Names in repro files (conformance.harness.ops registers them).
OP_TYPES: dict[str, type] = {"disagg-submit": Submit, "disagg-step": Step, "disagg-drain": Drain,
                             "disagg-abort": Abort, "disagg-fault": ArmFault}


def is_disagg(op) -> bool:
    return type(op) in OP_TYPES.values()
