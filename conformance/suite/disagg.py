"""The ``disagg`` family: prefill on one worker, decode on another, a real
transfer between them (NIXL 1.5.1 over UCX, two processes, when ``nixl``
imports; else the in-process copy transport -- the result says which).

A seeded rule-based generator draws each example's operations
(:mod:`conformance.harness.disagg.ops`): submissions whose transferred
prefix (N-1 tokens) ends on a block boundary of either worker, one token
either side, or mid-block, some sharing a prefix with earlier prompts
(prefill-side hits); steps (transfers stay in flight while other requests
decode on reused pages); drains; and environment events on the next transfer
(a killed peer, a dropped descriptor, a lost notification, corrupted bytes, a
truncated tail, reordered completions), which a correct implementation
survives by recomputing.  Examples alternate the two layout pairings.  Each
example is judged by :class:`~conformance.harness.disagg.session.DisaggSession`:
decode logits against the no-cache reference, every byte a decode step reads
audited, nothing held once every request finished.  A failure is minimized
by replaying subsets of its operations on fresh workers.

Workers are built once per pairing and check, and reused by its examples:
their memory is never cleared, so later examples meet earlier ones' bytes.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict

from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure
from conformance.harness.disagg import ops as dops
from conformance.harness.disagg.session import COUNTERS, DisaggSession
from conformance.harness.disagg.workers import Workers, build_workers, make_transport
from conformance.harness.ops import op_to_dict
from conformance.results.records import CheckResult, Failure

ARMABLE = ("kill-peer", "drop-descriptor", "lose-notification", "corrupt-bytes", "truncate-tail",
           "reorder-completions")
# Transferred prefix lengths T (prompts are T+1 tokens: prefill stops at N-1):
# on, one before and one after 16- and 32-token boundaries, and mid-block.
PREFIX_ENDS = (15, 16, 17, 31, 32, 33, 47, 48, 8, 20, 40)
SHARED = (0, 16, 32, 48)  # shared-prefix tokens: prefill-side hits at 16- and 32-token boundaries
MAX_ACTIVE = 3


def disagg_factory_of(factory):
    """The implementation's disaggregated mode: a ``disagg_factory`` class
    attribute, or the factory itself when it plans for two workers."""
    inner = getattr(factory, "disagg_factory", None)
    if inner is not None:
        return inner
    if callable(getattr(factory, "disagg_layouts", None)):
        return factory
    return None


def transport_kind() -> str:
    import os

    return os.environ.get("HCC_DISAGG_TRANSPORT", "auto")  # auto | nixl | inprocess


def generate(rng: random.Random, steps: int, example: int) -> list:
    """One example's operations (deterministic in ``rng``)."""
    out, active, n, armed = [], 0, 0, False
    for _ in range(steps):
        roll = rng.random()
        if active < MAX_ACTIVE and (roll < 0.45 or active == 0):
            T = rng.choice(PREFIX_ENDS)
            out.append(dops.Submit(f"e{example}r{n}", T + 1, rng.choice(SHARED), rng.choice((1, 2, 3))))
            n += 1
            active += 1
        elif roll < 0.75:
            out.append(dops.Step(rng.choice((1, 1, 2))))
        elif roll < 0.85 and not armed:
            out.append(dops.ArmFault(rng.choice(ARMABLE)))
            armed = True
        elif roll < 0.9 and n:
            out.append(dops.Abort(f"e{example}r{rng.randrange(n)}"))  # maybe mid-transfer
        else:
            out.append(dops.Drain())
            active, armed = 0, False
    out.append(dops.Drain())
    return out


def _pairing_config(pairing: str, impl_options: dict) -> ImplConfig:
    return ImplConfig(options={**dops.PAIRINGS[pairing], **impl_options})


def apply_all(session: DisaggSession, ops: list) -> int:
    """Apply ``ops``; returns how many ran before a failure (raises it)."""
    for i, op in enumerate(ops):
        session.applied = i
        dops.apply(session, op)
    return len(ops)


def replay_fails(dfactory, impl_config: ImplConfig, model, oracle, ops: list, kind: str = "auto"):
    """Apply ``ops`` to a fresh session on fresh workers; (failure or None, session)."""
    session = DisaggSession(dfactory(impl_config), model, oracle, kind)
    try:
        apply_all(session, ops)
    except ConformanceFailure as exc:
        return exc, session
    finally:
        session.close()
    return None, session


def run_disagg_check(factory, spec, model, oracle, opts, profile, index: int, notify=lambda *a, **k: None):
    from conformance.suite.minimize import minimize

    dfactory = disagg_factory_of(factory)
    if dfactory is None:
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           reason="the implementation has no disaggregated mode (no disagg_factory class "
                                  "attribute, no disagg_layouts())")
    examples = opts.examples or max(4, profile.examples // 4)
    steps = opts.steps or profile.steps
    rng = random.Random(opts.seed * 1000 + index)
    kind = transport_kind()
    started = time.perf_counter()
    coverage = dict.fromkeys(COUNTERS, 0)
    workers: dict[str, Workers] = {}
    status, failure, name, why, ran, nsteps = "passed", None, "", "", 0, 0
    try:
        for e in range(examples):
            pairing = sorted(dops.PAIRINGS)[e % 2]
            config = _pairing_config(pairing, opts.impl_options)
            impl = dfactory(config)
            if pairing not in workers:
                tr, why = make_transport(kind)
                workers[pairing] = build_workers(impl.disagg_layouts(), model.config, tr)
                name = tr.name
            ops = generate(rng, steps, e)
            session = DisaggSession(impl, model, oracle, kind, reuse=workers[pairing])
            session.applied = 0
            ran += 1
            try:
                apply_all(session, ops)
            except ConformanceFailure as exc:
                steps_done = ops[: session.applied + 1]
                failure = Failure(kind=exc.kind, message=str(exc), steps=[op_to_dict(o) for o in steps_done],
                                  examples_to_failure=ran, seconds_to_failure=round(time.perf_counter() - started, 3),
                                  impl_config=asdict(config))
                status = "failed"
                if opts.shrink == "ops":
                    _minimize(failure, dfactory, config, model, oracle, steps_done, kind, minimize)
                break
            finally:
                nsteps += session.coverage["steps"]
                for k, v in session.coverage.items():
                    coverage[k] += v
                session.close()
            notify("example", check=spec.id, examples=ran, steps=nsteps, of=examples)
    finally:
        for w in workers.values():
            w.close()
    if status == "passed":
        missing = [c for c in spec.required if coverage.get(c, 0) == 0]
        if missing:
            status = "failed"
            failure = Failure(kind="coverage", message=f"the {spec.family} situation never occurred: "
                                                       f"{', '.join(missing)} stayed at 0 over {ran} examples")
    return CheckResult(id=spec.id, family=spec.family, status=status,
                       description=f"{spec.description} [transport: {name or kind}]",
                       examples=ran, steps=nsteps, seconds=round(time.perf_counter() - started, 3),
                       coverage=coverage, failure=failure, metrics={"transport": name, "transport_why": why})


def _minimize(failure: Failure, dfactory, config, model, oracle, ops, kind, minimize) -> None:
    def still_fails(candidate) -> bool:
        exc, _ = replay_fails(dfactory, config, model, oracle, candidate, kind)
        return exc is not None and exc.kind == failure.kind

    if not still_fails(ops):
        return  # it depended on bytes an earlier example left behind: keep it whole
    best = minimize(list(ops), still_fails, budget_s=60.0)
    exc, _ = replay_fails(dfactory, config, model, oracle, best, kind)
    failure.steps = [op_to_dict(o) for o in best]
    failure.message = str(exc)


def replay_disagg(repro, factory, model, outcome):
    """Replay a disagg repro on fresh workers (transport as in a run: NIXL when it imports)."""
    from conformance.errors import ReproFormatError, UsageError
    from conformance.harness.oracle import Oracle

    dfactory = disagg_factory_of(factory)
    if dfactory is None:
        raise UsageError(f"{outcome.impl} has no disaggregated mode; this repro needs one")
    if not all(dops.is_disagg(op) for op in repro.steps):
        raise ReproFormatError("steps: disagg operations cannot mix with single-worker ones")
    session = DisaggSession(dfactory(repro.impl_config), model, Oracle(model), transport_kind())
    outcome.notes.append(f"transport: {session.transport_name} ({session.transport_why})")
    session.applied = 0
    try:
        apply_all(session, list(repro.steps))
        outcome.applied = len(repro.steps)
    except ConformanceFailure as exc:
        outcome.reproduced = True
        outcome.kind = exc.kind
        outcome.message = str(exc)
        outcome.failed_at = session.applied
        outcome.applied = session.applied
    finally:
        session.close()
    outcome.coverage = dict(session.coverage)
    outcome.notes += [f"fault {e.fault} fired on transfer {e.transfer_id} ({e.request_id}): {e.where}"
                      for e in session.events]
    return outcome
