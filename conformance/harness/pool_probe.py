"""Executing the pool probe (:class:`~conformance.harness.ops.Probe`), a
black-box lifetime check that believes nothing the implementation says about
itself: finish what is active, and step until no transfer is in flight
either (a request aborted while its load was in flight keeps its blocks
until the load completes, and a load completes only in a step: vLLM frees
them when the connector reports it in ``finished_recving``); then, at idle
(:meth:`~conformance.harness.session.Session.idle`), ``op.concurrent`` short
requests submitted together, and one ``op.kv_tokens``-token request, as a
fresh instance of the implementation serves them (the numbers are measured on
one, :mod:`conformance.generate.probe_sizing`).

The session only executes the probe's steps, and shows its checkers what they
need for a verdict: what the concurrent part's step scheduled
(:class:`~conformance.harness.checker.ProbeStep`) and any part that could not
be served (:class:`~conformance.harness.checker.ProbeStall`, with the prefix
a state slot held for the long request, by memory's provenance).  The verdict
(a leak: an ``invariant`` failure whose message starts "lifetime:") is
:mod:`conformance.judge.lifetime`'s; a stall no checker turns into one
stays a stall.

The probe's steps are dry (the model is not run, nothing of memory's bytes
changes, only provenance): it ends the session.

A mixin of :class:`~conformance.harness.session.Session`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.contract import StepPlan
from conformance.errors import ConformanceFailure
from conformance.harness.checker import ProbeStall, ProbeStep
from conformance.harness.ops import Probe, Submit
from conformance.harness.probe_prompts import SHORT_LEN, probe_prompts
from conformance.harness.step import STALL_STEPS

if TYPE_CHECKING:
    from conformance.harness.checker import CheckerSet
    from conformance.harness.memory import Memory
    from conformance.harness.runner import Runner
    from conformance.model import TinyHybrid


class PoolProbe:
    """The session's execution of the pool probe (see the module's docstring)."""

    if TYPE_CHECKING:  # what it uses of the session
        model: TinyHybrid
        memory: Memory
        runner: Runner
        checkers: CheckerSet
        probing: bool
        ended: bool
        last_plan: StepPlan | None
        _probes: int

        def active(self) -> list[str]: ...

        def _submit(self, op: Submit) -> None: ...

        def _step(self, budget: int, transfers: bool = False) -> None: ...

        def idle(self) -> bool: ...

        def _drain(self, budget: int) -> None: ...

    def _probe(self, op: Probe) -> None:
        self._drain(1024)
        for _ in range(STALL_STEPS):  # every transfer in flight lands in the next step; bounded all the same
            if self.idle():
                break
            self._step(1024, transfers=True)
        self.probing = self.runner.dry = True  # capacity, not logits: the steps are not computed
        self._probes += 1
        short, long = probe_prompts(self.model.config.vocab_size, op.kv_tokens, op.concurrent)
        try:
            ids = tuple(f"probe{self._probes}-c{i}" for i in range(len(short)))
            for rid, prompt in zip(ids, short, strict=True):
                self._submit(Submit(rid, prompt, 1))
            if ids:
                self.last_plan = None
                self._step(SHORT_LEN * len(ids))
                self.checkers.notify(ProbeStep(op, ids, self.last_plan or StepPlan()))
                self._probe_drain(op, "concurrent", len(ids), 0)
            if op.kv_tokens:
                self._submit(Submit(f"probe{self._probes}-kv", long, 1))
                self._probe_drain(op, "long", 1, self.memory.state_prefix_held(long))
        finally:
            self.probing = False
            self.ended = True  # the runner stays dry: memory's bytes no longer match its provenance

    def _probe_drain(self, op: Probe, part: str, requests: int, held: int) -> None:
        stalled = None
        try:
            self._drain(max(1024, SHORT_LEN * len(self.active())))
        except ConformanceFailure as exc:
            if exc.kind != "stall":
                raise
            stalled = exc
        if stalled is not None:
            # the lifetime judge makes it its verdict; without one, the stall stands
            self.checkers.notify(ProbeStall(op, part, requests, held, str(stalled)))
            raise stalled
