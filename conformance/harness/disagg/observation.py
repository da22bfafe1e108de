"""What a checker may read of a disaggregated session: the
:class:`DisaggObservation` protocol, the two-worker counterpart of
:class:`conformance.harness.observation.Observation`.

One memory (with byte provenance) and one layout per worker, the harness's
own record of every request (:class:`~conformance.harness.observation.Track`,
the single-worker one), the record so far, the transport that runs and the
transfers in flight.  It reads; it never writes.  Memory and tracks are the
session's live objects, handed out to be read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from conformance.disagg.contract import DisaggLayouts, DisaggTransfer

if TYPE_CHECKING:
    from conformance.harness.disagg.worker_memory import WorkerMemory
    from conformance.harness.observation import Record, Track


class DisaggObservation(Protocol):
    """The read-only face of a disaggregated session that its checkers see."""

    @property
    def layouts(self) -> DisaggLayouts:
        """Each worker's layout, as the implementation asked for them."""

    @property
    def memories(self) -> Mapping[str, WorkerMemory]:
        """Each worker's memory, by worker name (``prefill``, ``decode``)."""

    @property
    def tracks(self) -> Mapping[str, Track]: ...

    @property
    def history(self) -> Record: ...

    @property
    def step_no(self) -> int:
        """``schedule()`` calls so far."""

    @property
    def transport(self) -> str:
        """The name of the transport that carries the bytes (a failure names it)."""

    @property
    def in_flight(self) -> tuple[DisaggTransfer, ...]:
        """The transfers in flight in the latest step's transport tick: those
        submitted earlier or in that step, with chunks still to post when the
        tick began."""

    def active(self) -> list[str]: ...
