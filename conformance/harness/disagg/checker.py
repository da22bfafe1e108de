"""The checker protocol of a disaggregated session: the moments it shows its
checkers, and :class:`DisaggChecker`, their base class.

The protocol is :mod:`conformance.harness.checker`'s: the session shows each
moment, in order, to checkers composed in a
:class:`~conformance.harness.checker.CheckerSet` (here with
:data:`DISAGG_PHASE_OF`), each with a read-only
:class:`~conformance.harness.disagg.observation.DisaggObservation` (one
memory and layout per worker, the tracks, the record, the transfers in
flight); a checker counts its own coverage, notes what it could not check,
raises :class:`~conformance.errors.ConformanceFailure` for what is wrong and
never writes into the session; a checker that crashes is a
:class:`~conformance.errors.HarnessError` naming it.

Phases, in the order a session meets them, each with its moment:

- ``attached(obs)``: once, when the session is built (the workers connected);
- ``submitted(obs, Submitted)``: a request was added (the single-worker moment);
- ``scheduled(obs, DisaggScheduled)``: ``schedule()`` returned a plan over both
  workers; nothing ran yet;
- ``transfer(obs, TransferSubmitted)``: a transfer of the plan was handed to
  the transport (the history's event), its contract checked;
- ``computed(obs, WorkerComputed)``: one worker-tagged request step ran: its
  logits, the oracle's verdict and, on the decode worker, every byte it read
  that memory's provenance does not give to its tokens (``stale``); before
  ``update()`` hears of it;
- ``noticed(obs, NoticeReceived)``: a transfer's notice, delivered to the
  implementation in this step's result (the history's event);
- ``stepped(obs, DisaggStepRecord)``: the step is over (``update()`` returned);
- ``aborted(obs, Aborted)`` (the single-worker moment);
- ``settled(obs, DisaggSettled)``: a drain ended: every request finished and
  no transfer is in flight; the implementation's view then (None: it states none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conformance.contract import RequestStep
from conformance.disagg.contract import DisaggPlan, TransferNotice
from conformance.harness.checker import Aborted, BaseChecker, Submitted
from conformance.harness.history import NoticeReceived, TransferSubmitted

if TYPE_CHECKING:
    from conformance.harness.disagg.observation import DisaggObservation
    from conformance.harness.oracle import Verdict


@dataclass(frozen=True)
class DisaggScheduled:
    plan: DisaggPlan


@dataclass(frozen=True)
class WorkerComputed:
    """One worker-tagged request step ran on ``worker``'s memory.

    ``stale``: what memory's provenance says of the bytes the step read that
    were not written for its tokens (a KV position or a state from another
    sequence, poison, a tail neither zeroed nor its own), measured before the
    step wrote anything; read on the decode worker only (its tile kernel reads
    whole blocks; prefill reads exact ranges)."""

    worker: str
    step: RequestStep
    tokens: tuple[int, ...]  # the request's sequence when the step ran
    logits: torch.Tensor
    verdict: Verdict
    stale: tuple[str, ...] = ()

    @property
    def reads(self) -> str:
        """What the step read, in words (a logits failure says it)."""
        return "; ".join(self.stale) or "no stale byte found by the audit"


@dataclass(frozen=True)
class DisaggStepRecord:
    number: int  # the session's step number, 1-based
    plan: DisaggPlan
    sampled: tuple[tuple[str, int], ...]
    finished: tuple[str, ...]
    notices: tuple[TransferNotice, ...]


@dataclass(frozen=True)
class DisaggSettled:
    view: dict | None  # the implementation's view at rest (None: it states none)


#: The phase that shows each kind of moment of a disaggregated session.
DISAGG_PHASE_OF: dict[type, str] = {
    Submitted: "submitted", DisaggScheduled: "scheduled", TransferSubmitted: "transfer",
    WorkerComputed: "computed", NoticeReceived: "noticed", DisaggStepRecord: "stepped", Aborted: "aborted",
    DisaggSettled: "settled"}


class DisaggChecker(BaseChecker):
    """Base class of a disaggregated session's checkers: every phase is a
    no-op; a checker overrides the ones it judges."""

    _phases_are_no_ops = True

    def attached(self, obs: DisaggObservation) -> None: ...

    def submitted(self, obs: DisaggObservation, ev: Submitted) -> None: ...

    def scheduled(self, obs: DisaggObservation, ev: DisaggScheduled) -> None: ...

    def transfer(self, obs: DisaggObservation, ev: TransferSubmitted) -> None: ...

    def computed(self, obs: DisaggObservation, ev: WorkerComputed) -> None: ...

    def noticed(self, obs: DisaggObservation, ev: NoticeReceived) -> None: ...

    def stepped(self, obs: DisaggObservation, record: DisaggStepRecord) -> None: ...

    def aborted(self, obs: DisaggObservation, ev: Aborted) -> None: ...

    def settled(self, obs: DisaggObservation, ev: DisaggSettled) -> None: ...
