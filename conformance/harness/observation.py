"""What a checker may read of a session: the :class:`Observation` protocol.

A checker is shown each event of a session (:mod:`conformance.harness.checker`)
together with an observation: the harness's memory (with provenance), the
layout, the harness's own record of every request (:class:`Track`), the
record so far (:class:`~conformance.harness.history.History`), the host
store, and the facts the session measures (the step number, the entries
evicted so far).  It reads; it never writes: what it counts and what it could
not check are its own (``Checker.coverage``, ``Checker.notes``), and the
session collects them.  Memory and tracks are the session's live objects,
handed out to be read (copying memory every step would cost more than the
step).

One worker's session meets this protocol (``Session.observation``); the
disaggregated session hands its checkers its own
(:class:`~conformance.harness.disagg.observation.DisaggObservation`: one
memory and layout per worker, beside what the pair shares, the transfers in
flight between them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from conformance.contract import CacheView, Layout, Speculation, Transfer

if TYPE_CHECKING:
    from conformance.harness.history import Event
    from conformance.harness.memory import Memory, Prefix
    from conformance.harness.transport import HostStore


@dataclass
class Track:
    """The harness's own record of one request: its tokens and progress."""

    tokens: tuple[int, ...]
    prompt_len: int
    max_new: int
    continues: str | None
    generated: int = 0
    computed: int | None = None  # None until first scheduled
    steps: int = 0
    done: bool = False


class Record(Protocol):
    """The session's history as a checker reads it (its recording methods are the session's)."""

    @property
    def events(self) -> Sequence[Event]: ...

    def since(self, index: int) -> Sequence[Event]: ...

    def issued(self, transfer_id: int) -> Transfer | None: ...


class Observation(Protocol):
    """The read-only face of a session that its checkers see."""

    @property
    def layout(self) -> Layout: ...

    @property
    def memory(self) -> Memory: ...

    @property
    def tracks(self) -> Mapping[str, Track]: ...

    @property
    def history(self) -> Record: ...

    @property
    def step_no(self) -> int:
        """``schedule()`` calls so far."""

    @property
    def probing(self) -> bool:
        """While the pool probe runs: its requests are the harness's, not the check's."""

    @property
    def evicted(self) -> int:
        """Cached entries the implementation's view stopped listing, outside
        the pool probe, since the session began (memory held every listed
        entry to its provenance when it was listed)."""

    @property
    def last_view(self) -> CacheView | None:
        """The view after the latest step, transfer-only step or abort."""

    @property
    def plan_view(self) -> CacheView | None:
        """The view right after the latest ``schedule()`` that computed something."""

    @property
    def store(self) -> HostStore:
        """The harness's host store (the second tier's memory, with provenance)."""

    @property
    def transfers_succeeded(self) -> Mapping[str, int]:
        """Completed transfers by direction (``offload``, ``load``)."""

    @property
    def loaded_states(self) -> set[Prefix]:
        """State prefixes a tier load brought in whole."""

    @property
    def transfer_decisions(self) -> Mapping[str, int] | None:
        """What the generator's transfer control made happen, by name
        (:class:`~conformance.harness.transfer_control.TransferControl`), or
        None while no transfer was under its control."""

    @property
    def speculation(self) -> Speculation | None:
        """What the implementation declared of its speculative decoding, when
        it takes the harness's drafts (None: it does not speculate)."""

    def active(self) -> list[str]: ...

    def pending_loads(self) -> list[Transfer]: ...

    def declared(self, method: str) -> object:
        """The implementation's answer to an optional declaration method (a
        guarded call: ``retention()``), or None when it has none."""
