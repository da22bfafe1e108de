"""The contract between a hybrid cache implementation and the harness.

The harness owns the model and the physical memory; the implementation owns the
decisions.  Everything that crosses the boundary is a plain frozen dataclass so
that it can be recorded in a history, written to a repro file and compared.

One engine step, seen from the implementation:

1. ``schedule(budget)`` returns a :class:`StepPlan`: per request, which token
   range to compute, the attention block table, the recurrent state slot to
   extend and where its starting state comes from, snapshots to take, and any
   block / slot copies to do first.
2. The harness executes the plan on its memory with the model.  Only what is
   actually in memory counts: a slot the implementation *says* holds a state
   is never trusted, the bytes in it are used.
3. ``update(plan, result)`` tells the implementation which tokens were sampled;
   it returns the requests that finished (and frees them).

Sliding-window layers (optional, :data:`NULL_BLOCK`): a model may hold
window layers (``ImplConfig.windows``: the window of each window group, the
layers of one window forming one group, as vLLM's coordinator groups the
layers of one ``SlidingWindowSpec``).  A window layer at position q reads
only the KV of positions [q - W + 1, q].  Each window group has a block table
of its own (``RequestStep.window_tables[g]``, indexed like ``block_table``:
entry i for positions [i*B, (i+1)*B)); an entry whose positions the step
neither reads nor writes is never looked at: it may be :data:`NULL_BLOCK`
(vLLM's null block), a block freed and reused since, anything.  A block id
names one page of the one KV pool, shared by every group (vLLM's hybrid
allocator): writing block b for one group overwrites what b held for
another.  A step without ``window_tables`` reads and writes its window layers
through ``block_table``, as an engine with one group for every attention
layer does (vLLM without the hybrid allocator): correct, never freed early.

Later extensions (a second storage tier, a prefill and a decode worker with
their own memory, speculative decoding) add optional fields with defaults:
``RequestStep.worker``, ``StepPlan.transfers``, ``RequestStep.drafts`` and
``StepResult.accepted`` exist for that, so adapters written against this
version keep working.

Speculative decoding (optional, :class:`Speculation`): the harness is the
drafter and the verifier.  Between steps it may propose draft tokens for a
request in decode (``propose_drafts``); the implementation may verify a
prefix of them in that request's next step (``RequestStep.drafts``), saying
where the recurrent state after each verified position lives
(``RequestStep.draft_slots``); the harness computes them on its memory,
accepts the drafts that equal the no-cache reference's next tokens (the
generator chooses how many agree) and tells ``update()`` how many it accepted
(``StepResult.accepted``).  What is reusable afterwards is judged by memory:
exactly the accepted prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from conformance.errors import ContractError  # noqa: F401  (re-exported: adapters raise it)

#: Positions are token indices.  A *prefix length* p means tokens [0, p).


@dataclass(frozen=True)
class Layout:
    """What the implementation asks the harness to allocate."""

    block_size: int  # tokens per KV block (attention layers)
    num_kv_blocks: int  # physical KV blocks
    num_state_slots: int  # physical recurrent state slots (conv + matrix state each)
    # Per-layer window groups (optional): a partition of the model's W layers (their indices among the
    # W layers, in layer order; ``ImplConfig.layer_windows`` says each one's window), each group of one
    # window, read and written through one table.  Empty: one group per distinct window
    # (``ImplConfig.windows``).  vLLM gives each *layer group* its own table (``get_kv_cache_groups``: a
    # Gemma 3 pattern of 5 window layers and 1 full layer is five window groups of one window); then
    # ``RequestStep.window_tables``, ``CachedKV.window_group`` and ``Transfer.window_group`` index these.
    window_layer_groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_kv_blocks < 1 or self.num_state_slots < 1:
            raise ValueError(f"layout values must be positive: {self}")
        object.__setattr__(self, "window_layer_groups", tuple(tuple(g) for g in self.window_layer_groups))


@dataclass(frozen=True)
class ImplConfig:
    """What the harness asks of an implementation when it builds one:
    ``Class(config)``.  An implementation may round the sizes (it reports what
    it really uses through :meth:`CacheImplementation.layout`)."""

    block_size: int = 4
    num_kv_blocks: int = 64
    num_state_slots: int = 32
    options: dict = field(default_factory=dict)  # policy knobs, e.g. {"interval": 8}
    # The model's window groups: the window W of each (a layer of group g at
    # position q reads [q - W + 1, q]); empty for a model without window layers.
    windows: tuple[int, ...] = ()
    # The model's layers, for a cache that lays out its groups per layer (vLLM: one KV cache group per
    # layer group, ``Layout.window_layer_groups``): the kind of each (R recurrent, A full attention, W
    # window) and each one's window (0 for R and A).  Given with ``windows``, for a model with window layers.
    layer_kinds: str = ""
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("windows", "layer_windows"):
            if isinstance(getattr(self, name), list):  # from a repro file
                object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class Request:
    """A request as the harness submits it."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 1


@dataclass(frozen=True)
class StateInit:
    """Where the recurrent state of a step comes from before extending.

    - ``fresh``: zero state (only meaningful when the step starts at 0),
    - ``resume``: the running slot already holds the state at ``start``,
    - ``copy``: copy slot ``source`` into the running slot first
      (copy-before-extend from a snapshot).
    """

    kind: Literal["fresh", "resume", "copy"]
    source: int | None = None
    # Which parts a copy takes.  Engines copy the conv and the matrix state as
    # separate tensors; forgetting one is a real bug, so it is expressible.
    parts: tuple[str, ...] = ("conv", "ssm")

    def __post_init__(self) -> None:
        if self.kind not in ("fresh", "resume", "copy"):
            raise ValueError(f"unknown StateInit kind {self.kind!r}")
        if (self.kind == "copy") != (self.source is not None):
            raise ValueError("StateInit.source is set exactly when kind == 'copy'")


FRESH = StateInit("fresh")
RESUME = StateInit("resume")


def copy_from(slot: int, parts: tuple[str, ...] = ("conv", "ssm")) -> StateInit:
    return StateInit("copy", slot, parts)


@dataclass(frozen=True)
class RequestStep:
    """What to compute for one request in one step."""

    request_id: str
    start: int  # first position computed; tokens [0, start) are taken from memory
    end: int  # exclusive
    block_table: tuple[int, ...]  # KV blocks for positions [0, end), block i holds [i*B, (i+1)*B)
    state_slot: int  # running slot that the recurrent layers extend in place
    state_init: StateInit = RESUME
    # (position, slot): after computing up to ``position`` (start < position <= end)
    # copy the running state (conv and matrix parts) into ``slot``.
    snapshots: tuple[tuple[int, int], ...] = ()
    worker: str = "main"  # reserved for prefill/decode pairs
    # Speculative decoding (see Speculation): draft tokens verified after ``end``,
    # computed at positions [end, end + len(drafts)) with logits for each; a
    # prefix of the drafts the harness proposed for this request, only on a step
    # that reaches the request's last known token (``end`` = its length).
    # Snapshot positions may then reach ``end + len(drafts)``; one at a draft
    # position is taken only where the verifier accepts through it (as an engine
    # copies the accepted column after verification: vLLM's postprocess_mamba).
    drafts: tuple[int, ...] = ()
    # Where the state of each verified position lives.  Per-position state slots
    # (vLLM's speculative state blocks, ``MambaSpec.num_speculative_blocks``):
    # ``draft_slots[i]`` receives the state after position ``end + i + 1``
    # (draft i consumed) and ``state_slot`` the state after ``end``; one slot per
    # draft, all distinct.  Empty (an explicit rollback scheme): ``state_slot`` is
    # extended in place through every draft, and the implementation restores what
    # it rejected itself (a snapshot at ``end``, then recomputing from there).
    draft_slots: tuple[int, ...] = ()
    # Sliding-window layers: one block table per window group (ImplConfig.windows, or the groups the
    # implementation declares in Layout.window_layer_groups),
    # read like ``block_table`` for the positions a window layer reads: a step
    # [start, end) of group g (window W) reads [max(0, start - W + 1), start) and
    # writes [start, end) (through its drafts).  Entries for blocks wholly before
    # what it reads may be NULL_BLOCK.  Empty: the window layers use ``block_table``.
    window_tables: tuple[tuple[int, ...], ...] = ()


#: A block table entry that names no block: a window group's block that left
#: the window (vLLM's null block).  Reading a position through it is a contract error.
NULL_BLOCK = -1


@dataclass(frozen=True)
class Transfer:
    """One copy between device memory and the harness's host store.

    ``offload`` copies device block/slot ``device`` into host entry ``key``;
    ``load`` copies host entry ``key`` into ``device``.  Transfers run before the
    step's copies and computations; their completion comes back in
    :attr:`StepResult.transfers`, possibly a step later and in any order, and
    a load's data is only trustworthy once its checksum is verified.
    """

    id: int  # unique per implementation: completions are matched by it, never by position
    direction: Literal["offload", "load"]
    kind: Literal["kv", "state"]
    key: str
    device: int  # KV block (kind "kv") or state slot (kind "state")
    request_id: str | None = None  # the request a load is for (faults can target it)
    # kind "kv": the window group whose layers' KV the page holds (None: the full attention layers')
    window_group: int | None = None

    def __post_init__(self) -> None:
        if self.direction not in ("offload", "load") or self.kind not in ("kv", "state"):
            raise ValueError(f"bad transfer {self}")


@dataclass(frozen=True)
class TransferDone:
    """A completed transfer.  ``checksum``: for an offload, of the source bytes
    (what the store keeps to verify against); for a load, of the bytes that
    landed on the device.  ``ok`` False: nothing usable arrived (``error`` says why)."""

    id: int
    ok: bool
    checksum: str | None = None
    error: str = ""


@dataclass(frozen=True)
class StepPlan:
    """One engine step.  Copies happen before any request is computed."""

    requests: tuple[RequestStep, ...] = ()
    kv_copies: tuple[tuple[int, int], ...] = ()  # (src block, dst block)
    state_copies: tuple[tuple[int, int], ...] = ()  # (src slot, dst slot)
    transfers: tuple[Transfer, ...] = ()  # host-tier offloads and loads, run first


@dataclass(frozen=True)
class StepResult:
    """What the harness hands back after executing a plan."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    transfers: tuple[TransferDone, ...] = ()  # completions since the last step
    # Speculative decoding: request id -> how many of the step's drafts were
    # accepted (0..len(drafts)), for every request whose step verified drafts.
    # The request's sequence grows by drafts[:accepted] and then sampled[id]
    # (the token after the last accepted draft); it has computed end + accepted.
    # The harness drafts past a request's last token, as engines do: accepted
    # never exceeds the tokens the request may still generate, and when the
    # accepted drafts reach max_new_tokens no token is sampled (the request
    # finished inside the verification; update() reports it).
    accepted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CachedKV:
    """A KV block the implementation holds as reusable for ``tokens``.

    ``tokens`` is the whole prefix ending with this block's last valid position,
    so block ``block`` must hold the KV of positions
    [len(tokens) - n, len(tokens)) where n = len(tokens) - block_index*B.
    """

    block: int
    tokens: tuple[int, ...]
    # The window group whose layers' KV the block holds (None: the full
    # attention layers').  A window group's block is listed while it holds its
    # positions' KV, whether or not it left a request's window.
    window_group: int | None = None


@dataclass(frozen=True)
class CachedState:
    """A recurrent snapshot the implementation holds as the state after ``tokens``."""

    slot: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class HostCached:
    """A host-tier entry the implementation holds as loadable for ``tokens``:
    the harness store's entry ``key`` (an offload that completed: listed from
    its completion on, no earlier), read like :class:`CachedKV` (``kind``
    "kv": the KV of the block that ends the prefix, for the full attention
    layers or ``window_group``'s) or :class:`CachedState` (``kind`` "state":
    the state after ``tokens``).  Judged against the bytes the store holds
    (their provenance), as device entries are judged against memory: a tier
    that stores a block after its new owner wrote it, under the old prefix's
    key, is seen when it publishes the entry, not only if a later request
    happens to load it."""

    key: str
    tokens: tuple[int, ...]
    kind: Literal["kv", "state"] = "kv"
    window_group: int | None = None


@dataclass(frozen=True)
class CacheView:
    """The implementation's bookkeeping, as it states it; the harness checks it
    against memory.  Empty collections are fine for what an implementation
    does not track (the result then notes the reduced assurance; leaks are
    still found by the pool probe, which needs no view).

    A *refcount* is the number of holders of a block or slot other than the
    cache itself: requests (running, or admitted and waiting), and copies or
    transfers of a step that have not run yet.  The cache's own retention is
    not a reference: an entry that is only cached (listed in ``cached_kv`` /
    ``cached_states``, reusable and evictable) has refcount 0, like a free one.
    The harness checks that every block a scheduled request uses has
    refcount >= 1, and that at idle (no request active, no transfer in flight)
    every refcount is 0: one above 0 then is a leak."""

    kv_refcounts: dict[int, int] = field(default_factory=dict)  # block -> holders (0 = free or only cached)
    state_refcounts: dict[int, int] = field(default_factory=dict)  # slot -> holders (0 = free or only cached)
    cached_kv: tuple[CachedKV, ...] = ()
    cached_states: tuple[CachedState, ...] = ()
    running: tuple[str, ...] = ()  # requests that hold memory
    # The host tier's entries, where the implementation has one and can say what each
    # holds (empty: not judged; the expected-hit oracle and the logits still are)
    host_cached: tuple[HostCached, ...] = ()


@dataclass(frozen=True)
class Speculation:
    """What an implementation that verifies draft tokens declares (optional
    ``speculation()``; None: it does not).

    - ``max_drafts``: drafts it verifies in one step at most (vLLM's
      ``num_speculative_tokens``); the harness proposes no more.
    - ``scheme``: where the states of the verified positions live:
      ``"per-position"`` (``RequestStep.draft_slots``) or ``"rollback"`` (in
      place, the implementation restores the rejected part itself).
    - ``hit_drop``: tokens a non-zero KV hit gives back so that the drafter
      recomputes their hidden states (EAGLE and MTP: vLLM's ``drop_eagle_block``
      takes one hash unit, or one block, off the attention hit): the
      expected-hit oracle expects a reuse of at most the KV hit less this many
      tokens, and a state there.
    """

    max_drafts: int
    scheme: Literal["per-position", "rollback"] = "per-position"
    hit_drop: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_drafts, int) or self.max_drafts < 1:
            raise ValueError(f"Speculation.max_drafts must be an integer >= 1, got {self.max_drafts!r}")
        if self.scheme not in ("per-position", "rollback"):
            raise ValueError(f"Speculation.scheme must be 'per-position' or 'rollback', got {self.scheme!r}")
        if not isinstance(self.hit_drop, int) or self.hit_drop < 0:
            raise ValueError(f"Speculation.hit_drop must be an integer >= 0, got {self.hit_drop!r}")


@runtime_checkable
class CacheImplementation(Protocol):
    """What an adapter provides.  See the README, "Writing an adapter"."""

    name: str
    version: str

    def layout(self) -> Layout: ...

    def add_request(self, request: Request) -> None: ...

    def schedule(self, budget: int) -> StepPlan: ...

    def update(self, plan: StepPlan, result: StepResult) -> list[str]: ...

    def abort(self, request_id: str) -> None: ...

    def view(self) -> CacheView: ...


#: What the harness builds an implementation with: a class, or any callable ``f(config)``.
ImplFactory = Callable[[ImplConfig], CacheImplementation]

REQUIRED_METHODS = ("layout", "add_request", "schedule", "update", "abort", "view")

# Optional, so adapters written before it keep working (not in the Protocol,
# which ``isinstance`` would then demand):
#
#   retention() -> dict   the retention policy as plain data, e.g.
#       {"interval": None | I (0 = prompt ends only), "admission": "always" | "second-hit",
#        "prompt_ends": True, "sequence_ends": bool}
#
# An implementation that declares one is checked against it (families
# "retention" and "hit-rate", see conformance/retention.py); one that does not
# has those checks skipped.
#
#   speculation() -> Speculation | None   whether (and how) it verifies drafts;
#   propose_drafts(request_id, tokens)    the harness's drafts for the request's
#       next step (replacing any earlier proposal); it may verify a prefix of
#       them there (RequestStep.drafts), or none.  A proposal lasts until the
#       request's next computed step.
#
# Both, or the "spec" family is skipped (with ``spec_option``, a class
# attribute ``("option", value)`` that turns speculative decoding on, as
# ``tier_option`` turns on a second tier).
#
#   engine_config() -> dict   what the engine was really started with for the
#       configuration it was built with (pool, lengths, release), as plain data:
#       recorded with each check's result (``CheckResult.engine_config``).
OPTIONAL_METHODS = ("retention", "speculation", "propose_drafts", "engine_config")


def missing_methods(obj: object) -> list[str]:
    """Names of contract methods ``obj`` lacks (used for clear usage errors)."""
    return [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
