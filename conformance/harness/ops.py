"""Operations: the vocabulary of histories and repro files.

A generator (the Hypothesis machine, a scenario file, a workload) produces
operations; a :class:`~conformance.harness.session.Session` applies them.  Each is a
plain dataclass with a JSON form, so a minimized failure is data that replays
anywhere without executing code from the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Submit:
    """Add a request.  ``continues`` names the request whose whole sequence
    this prompt replays (a multi-turn continuation), for coverage only."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 1
    continues: str | None = None


@dataclass(frozen=True)
class Step:
    """One engine step with a token budget."""

    budget: int


@dataclass(frozen=True)
class Drain:
    """Steps with ``budget`` until no request is active (a stall after
    :data:`MAX_DRAIN_STEPS`)."""

    budget: int


#: The most engine steps a drain takes before the requests still active are a
#: stall: one limit for both families (``Drain`` here, ``DisaggDrain`` of the
#: disaggregated one).
MAX_DRAIN_STEPS = 400


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Probe:
    """The pool probe (a black-box lifetime check, executed by
    :mod:`conformance.harness.pool_probe`, judged by
    :mod:`conformance.judge.lifetime`): finish what is
    active, then at idle submit ``concurrent`` short requests together (a
    fresh instance schedules ``expect`` of them in its first step) and then
    one ``kv_tokens``-token request (a fresh instance serves it).  Its prompts
    are fixed by these numbers (:func:`conformance.harness.probe_prompts.probe_prompts`)."""

    kv_tokens: int
    concurrent: int = 0
    expect: int = 0


# -- transfers under the generator's control -------------------------------------------
# The wire of the host tier (harness/transfer_control.py) is deterministic by
# default: every transfer completes in the step that issued it.  These three
# operations put its timing and outcomes in the history, so a race between a
# load and the rest of the schedule shrinks and replays like any other step.


@dataclass(frozen=True)
class HoldTransfers:
    """From now on every load stays pending after the step that issued it: it
    lands (and its completion is reported) at the start of the next step,
    unless a :class:`Deliver` decided otherwise."""


#: How a decided load completes: whole, failed (nothing usable arrives, the
#: completion says so), or short (half of a block's positions, or the conv
#: state without the matrix state, reported as a success).
OUTCOMES = ("ok", "fail", "short")


@dataclass(frozen=True)
class Deliver:
    """Decide one pending load: the ``pick``-th undecided one by transfer id
    (modulo their number) completes with ``outcome`` after ``delay`` more steps.  Loads due
    in the same step are reported in the order of their decisions, before the
    undecided ones (so deciding a later load first delivers out of order).
    Nothing happens when no undecided load is pending."""

    pick: int = 0
    outcome: str = "ok"
    delay: int = 0


@dataclass(frozen=True)
class StoreEvict:
    """The host store drops the entry that the ``pick``-th pending load (by
    transfer id, modulo their number) is about to read: an eviction after the
    store answered the lookup.  Nothing happens when no load is pending."""

    pick: int = 0


# -- speculative decoding: the harness as the drafter ------------------------------------


@dataclass(frozen=True)
class Draft:
    """Propose ``count`` draft tokens for the next step of a request in decode
    (every known token but the last sampled one computed), of which the first
    ``agree`` are the no-cache reference's next tokens and the next one is not
    (so exactly ``min(agree, count)`` of them are accepted when verified).
    The tokens follow from these numbers and the model alone
    (:func:`conformance.harness.speculation.draft_tokens`).  ``count`` is
    capped at what the implementation verifies (``Speculation.max_drafts``)
    and at the request's remaining tokens less one; nothing happens for a
    request that is not in decode, or an implementation that does not
    speculate.  ``count`` 0 withdraws a proposal."""

    request_id: str
    count: int = 1
    agree: int = 0


Op = Submit | Step | Drain | Abort | Probe | HoldTransfers | Deliver | StoreEvict | Draft
OP_TYPES: dict[str, type] = {"submit": Submit, "step": Step, "drain": Drain, "abort": Abort, "probe": Probe,
                             "hold-transfers": HoldTransfers, "deliver": Deliver, "store-evict": StoreEvict,
                             "draft": Draft}
# The disaggregated family's operations (applied to a DisaggSession, not a Session).
from conformance.harness.disagg.ops import ARMABLE as _ARMABLE  # noqa: E402
from conformance.harness.disagg.ops import OP_TYPES as _DISAGG_OPS  # noqa: E402
from conformance.harness.disagg.ops import DisaggOp  # noqa: E402

OP_TYPES.update(_DISAGG_OPS)
_NAMES = {cls: name for name, cls in OP_TYPES.items()}


def op_to_dict(op: Op | DisaggOp) -> dict:
    d = {"op": _NAMES[type(op)], **asdict(op)}
    if "prompt" in d:
        d["prompt"] = list(d["prompt"])
    return d


def op_from_dict(d: dict) -> Op:
    """Parse one operation; raises ValueError naming the bad field."""
    if not isinstance(d, dict):
        raise ValueError(f"operation must be an object, got {type(d).__name__}")
    name = d.get("op")
    if name not in OP_TYPES:
        raise ValueError(f"op: unknown operation {name!r} (expected one of {sorted(OP_TYPES)})")
    cls = OP_TYPES[name]
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in d.items():
        if key == "op":
            continue
        if key not in known:
            raise ValueError(f"{name}.{key}: unknown field")
        kwargs[key] = value
    if "prompt" in kwargs:
        p = kwargs["prompt"]
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"{name}.prompt: must be a non-empty list of token ids")
        kwargs["prompt"] = tuple(p)
    for key in ("budget", "max_new_tokens"):
        if key in kwargs and (not isinstance(kwargs[key], int) or kwargs[key] < 1):
            raise ValueError(f"{name}.{key}: must be a positive integer")
    for key in ("pick", "delay", "count", "agree"):
        if key in kwargs and (not isinstance(kwargs[key], int) or isinstance(kwargs[key], bool) or kwargs[key] < 0):
            raise ValueError(f"{name}.{key}: must be an integer >= 0")
    if "outcome" in kwargs and kwargs["outcome"] not in OUTCOMES:
        raise ValueError(f"{name}.outcome: must be one of {', '.join(OUTCOMES)}")
    for key in ("kv_tokens", "concurrent", "expect"):
        if key in kwargs and (not isinstance(kwargs[key], int) or kwargs[key] < 0):
            raise ValueError(f"{name}.{key}: must be a non-negative integer")
    for key in ("request_id",):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise ValueError(f"{name}.{key}: must be a string")
    _check_disagg_fields(name, kwargs)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _check_disagg_fields(name: str, kwargs: dict) -> None:
    """The disaggregated operations' fields (``disagg-submit``, ``disagg-step``,
    ``disagg-fault``), refused here as the single-worker ones are above."""
    if name not in _DISAGG_OPS:
        return

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for key in ("prompt_len", "max_new", "count"):
        if key in kwargs and (not is_int(kwargs[key]) or kwargs[key] < 1):
            raise ValueError(f"{name}.{key}: must be a positive integer")
    if "shared" in kwargs and (not is_int(kwargs["shared"]) or kwargs["shared"] < 0):
        raise ValueError(f"{name}.shared: must be an integer >= 0")
    if "kind" in kwargs and kwargs["kind"] not in _ARMABLE:
        raise ValueError(f"{name}.kind: must be one of {', '.join(_ARMABLE)} (faults armed mid-run)")
