"""The checkers of a disaggregated session (prefill and decode on two
workers, :mod:`conformance.harness.disagg`), each one concern, over the
moments of :mod:`conformance.harness.disagg.checker`:

- :mod:`~conformance.judge.disagg.logits`: every computed logit, on either
  worker, against the no-cache oracle;
- :mod:`~conformance.judge.disagg.reads`: every byte a decode step read was
  written for its tokens or is a zeroed tail (memory's provenance says);
- :mod:`~conformance.judge.disagg.lifetime`: nothing held at rest, once a
  drain finished every request;
- :mod:`~conformance.judge.disagg.coverage`: the situations a run reached.

:func:`disagg_checkers` composes them in the one place that decides the order.
"""

from __future__ import annotations

from typing import Any

from conformance.contract import ImplConfig
from conformance.harness.checker import BaseChecker
from conformance.harness.disagg.faults import FaultSpec
from conformance.harness.disagg.session import DisaggSession, make_disagg_session
from conformance.harness.disagg.workers import WorkerPool
from conformance.harness.oracle import Oracle
from conformance.judge.disagg.coverage import COUNTERS, DisaggCoverage
from conformance.judge.disagg.lifetime import NothingHeldAtRest
from conformance.judge.disagg.logits import DisaggLogitsMatchReference
from conformance.judge.disagg.reads import DecodeReadsAudited
from conformance.model import TinyHybrid

__all__ = ["COUNTERS", "disagg_checkers", "judged_disagg_session"]


def disagg_checkers() -> list[BaseChecker]:
    """The checkers of one disaggregated session, in order: the logits
    first (a wrong logit is the failure, and it says what the audit found),
    then the audit of what decode read (stale bytes that happened to leave the
    logits right), the coverage (so a failing step is not counted), and the
    state at rest."""
    return [DisaggLogitsMatchReference(), DecodeReadsAudited(), DisaggCoverage(), NothingHeldAtRest()]


def judged_disagg_session(disagg_factory: Any, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
                          transport: str = "auto", faults: tuple[FaultSpec, ...] = (), pool: WorkerPool | None = None,
                          timeout: float | None = 30.0, extra: tuple[BaseChecker, ...] = ()) -> DisaggSession:
    """A disaggregated session judged by :func:`disagg_checkers` (plus
    ``extra``): the way to drive a disaggregated implementation by hand."""
    return make_disagg_session(disagg_factory, impl_config, model, oracle, [*disagg_checkers(), *extra],
                               transport, faults, pool, timeout)
