"""Known defects during a run: the table of the installed engine version, the
classifier the state machine asks about each failure, and the replay of each
open defect's pinned repro (FIXED is decided there, never by a check that
happened to pass).

How exploration goes on past a known defect (``generate/machine.py``): the
machine is given :class:`Classifier`; when a failure is a known defect of this
version the example records it (the operations so far, once per defect per
check, with a count) and *stops*: every later rule of that example touches
nothing (the session may be half-way through a step that raised), the pool
probe is not run, and the example ends valid.  Hypothesis therefore never sees
a known defect as a failure: it does not stop there, never shrinks towards it
(a NEW failure cannot slip into a known one), and spends the rest of the
check's example budget exploring.  Afterwards each defect's first example is
minimized by replay (``suite/minimize.py``) to that same defect."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conformance.errors import CompareInputError, ConformanceFailure, ImplementationError, ReproFormatError, UsageError
from conformance.results.defects import DefectTable, implementation_facts, load_table
from conformance.results.expectations import find_expectations, load_expectations


class CheckIds:
    """The check ids a results file can hold: the suite's checks (a variant
    names its check's id before the brackets), the faults check, and the
    engine-level checks (``engine_ids``, from the layer above, which knows the
    engine's profiles; without them an ``engine-<family>:<model>`` id is judged
    by its shape only)."""

    ENGINE_ID = re.compile(r"^engine-[a-z-]+:[A-Za-z0-9._-]+(\+[A-Za-z0-9._-]+)?$")

    def __init__(self, engine_ids: set[str] | None = None):
        from conformance.suite.checks import CHECKS, MIXED

        self.ids = {s.id for s in (*CHECKS, MIXED)} | {"faults-exercised"}
        self.engine_ids = engine_ids

    def __contains__(self, cid: object) -> bool:
        if cid in self.ids:
            return True
        if self.engine_ids is not None:
            return cid in self.engine_ids
        return isinstance(cid, str) and self.ENGINE_ID.match(cid) is not None

    def __iter__(self):
        return iter(sorted(self.ids | (self.engine_ids or set())))


@dataclass
class Expectations:
    """The expectations file of a run: its per-check entries and its defects table."""

    path: Path
    doc: dict
    table: DefectTable


def load_for_run(path: str | Path, engine_ids: set[str] | None = None) -> Expectations:
    """Load and validate an expectations file for a run: every bad entry (an
    unknown check id, a malformed defect, a pinned repro that is not this
    defect) is a usage error before any work."""
    try:
        doc = load_expectations(path, known_checks=CheckIds(engine_ids))
        table = load_table(doc, Path(path))
    except CompareInputError as exc:
        raise UsageError(str(exc)) from None
    return Expectations(Path(path), doc, table)


def expectations_for(impl: str, version: str, explicit: str | Path | None = None,
                     engine_ids: set[str] | None = None, build: str = "") -> Expectations | None:
    """The file a run is judged by: the one given, else the one written for
    this adapter, engine version and build (fixtures/expectations/), if any."""
    path = explicit or find_expectations(impl, version, build=build)
    return load_for_run(path, engine_ids) if path else None


def check_expectations_engine(doc: dict, path, impl: str, name: str, build: str = "") -> None:
    """``--expectations FILE`` of another engine is a usage error naming both:
    its known defects and expected failures would be matched against another
    engine's failures (a vLLM defect's signature explaining a reference
    failure: a false "as expected"), and its unlisted checks expected to
    pass.  The file fits when it lists the run's ``--impl`` among its ``impl``
    or names the implementation (its ``name``, or its build) as its
    ``engine``.  Another *version* of the same engine is allowed: judging a
    new release by the previous release's file is how an upgrade starts
    (docs/upgrading-vllm.md), and FIXED says what the new release mended."""
    impls = doc.get("impl")
    impls = [impls] if isinstance(impls, str) else list(impls or [])
    engine = str(doc.get("engine", ""))
    if impl in impls or engine in {name, build} - {""}:
        return
    listed = f" (impl {', '.join(impls)})" if impls else ""
    raise UsageError(f"--expectations {path}: the file is for the engine {engine!r}{listed}, this run is of "
                     f"{name!r} (--impl {impl}); use {name}'s expectations file, or write one")


def check_fix_target(mutant_name: str | None, expectations: Expectations | None) -> None:
    """A fix (a mutant of bug class FIX) names the known defect whose cause it
    removes: an id the engine version's table does not hold is a usage error."""
    if not mutant_name:
        return
    from fault_injection.catalog import get_mutant

    fixes = getattr(get_mutant(mutant_name), "fixes", None)
    if fixes is None:
        return
    known = expectations.table.defects if expectations is not None else {}
    if fixes not in known:
        where = f"in {expectations.path}" if expectations is not None else "(no expectations file for this version)"
        raise UsageError(f"--mutant {mutant_name}: fixes the defect {fixes!r}, which is not a known defect {where} "
                         f"(known: {', '.join(known) or 'none'})")


class Classifier:
    """``known(exc) -> Defect | None`` for one check: the open defect of the
    table that explains the failure under this check's facts."""

    def __init__(self, table: DefectTable, facts: dict):
        self.table, self.facts = table, facts

    def __call__(self, exc: Exception):
        kind = getattr(exc, "kind", None)
        match = self.table.classify(kind, str(exc), self.facts)
        return match.defect if match is not None and not match.regressed else None


def classifier_for(expectations: Expectations | None, factory, impl_config) -> tuple[Classifier | None, dict]:
    facts = implementation_facts(factory, impl_config)
    if expectations is None or not expectations.table.defects:
        return None, facts
    return Classifier(expectations.table, facts), facts


# -- pinned repros ------------------------------------------------------------------


def replay_pinned(expectations: Expectations | None, factory, model, oracle, timeout: float | None) -> list[dict]:
    """Replay each open defect's cache-level pinned repro on the run's
    implementation (the installed version, with the run's mutant if any).
    One record per defect: ``reproduces`` (the same defect), ``fixed`` (no
    failure: its cause is gone), ``changed`` (another failure: new) or
    ``not replayed`` (an engine-level repro: the engine run replays those)."""
    if expectations is None:
        return []
    return [replay_defect(expectations, d, factory, model, oracle, timeout) for d in pinned_defects(expectations)]


def pinned_defects(expectations: Expectations | None) -> list[str]:
    """The open defects with a pinned repro, in the file's order: one replay (and one plugin item) each."""
    if expectations is None:
        return []
    return [d.id for d in expectations.table.open() if d.repro is not None]


def replay_defect(expectations: Expectations, defect_id: str, factory, model, oracle,
                  timeout: float | None) -> dict:
    """The replay of one open defect's pinned repro (a record as ``replay_pinned`` makes)."""
    from conformance.results.pinned import load_any

    defect = expectations.table.defects[defect_id]
    assert defect.repro is not None, "an open defect pins a repro (validated when the file is loaded)"
    pinned = load_any(defect.repro)
    if pinned.level != "cache":
        return {"defect": defect.id, "outcome": "not replayed", "repro": str(defect.repro),
                "note": "an engine-level repro: run --impl vllm-engine replays it"}
    return replay_one(expectations.table, defect, pinned, factory, model, oracle, timeout)


def replay_one(table: DefectTable, defect, pinned, factory, model, oracle, timeout) -> dict:
    from conformance.harness.oracle import Oracle
    from conformance.model import TinyHybrid
    from conformance.suite.minimize import replay_fails
    from conformance.suite.repro_setup import observers_of

    repro = pinned.repro
    if model is None or model.config != repro.model:
        model = TinyHybrid(repro.model)
        oracle = Oracle(model)
    from conformance.suite.repro_setup import prepare_factory

    facts = implementation_facts(factory, repro.impl_config)
    record = {"defect": defect.id, "repro": str(defect.repro), "operations": len(repro.operations)}
    try:
        prepare_factory(factory, repro)  # the configurations its options need, outside every call's timeout
    except ReproFormatError as bad:
        return {**record, "outcome": "changed", "kind": "harness", "message": f"the repro no longer applies: {bad}"}
    for attempt_timeout in (timeout, None if timeout is None else 4 * timeout):
        # A timeout is retried once with four times the time: on a loaded machine building an engine can
        # take longer than a call should, and a pinned repro must not read "changed" for that.
        try:
            # A limitation met only under environment faults pins a repro with them (seeded: the same firings).
            attach = _faults_of(repro)
            exc, _session = replay_fails(factory, repro.impl_config, model, oracle, repro.operations, attach,
                                         timeout=attempt_timeout, families=observers_of(repro.check))
        except (ConformanceFailure, ImplementationError) as raised:  # the implementation could not even be built
            exc = raised
        except ValueError as bad:
            return {**record, "outcome": "changed", "kind": "harness",
                    "message": f"the repro no longer applies: {bad}"}
        if getattr(exc, "kind", None) != "timeout":
            break
    if exc is None:
        return {**record, "outcome": "fixed"}
    match = table.classify(getattr(exc, "kind", None), str(exc), facts)
    if match is not None and match.defect.id == defect.id:
        return {**record, "outcome": "reproduces", "kind": exc.kind, "message": str(exc)[:500]}
    return {**record, "outcome": "changed", "kind": getattr(exc, "kind", None), "message": str(exc)[:500]}


def _faults_of(repro):
    """The repro's environment faults, fresh, as its run attached them (None without)."""
    if not repro.faults:
        return None
    from fault_injection.environment import build_faults

    return build_faults(tuple(repro.faults), repro.seed).attach


def minimize_known(met, factory, impl_config, model, oracle, observe, known: Classifier, timeout,
                   budget_s: float = 30.0) -> tuple[list[dict], str, list[dict]]:
    """The first example that met a known defect, minimized by replay to
    that same defect: (operations, message, events)."""
    from conformance.harness.ops import op_from_dict, op_to_dict
    from conformance.suite.minimize import minimize, replay_fails

    def outcome(ops):
        return replay_fails(factory, impl_config, model, oracle, ops, None, timeout=timeout, families=observe)

    def same(ops) -> bool:
        exc, _ = outcome(ops)
        defect = known(exc) if exc is not None else None
        return defect is not None and defect.id == met.defect.id

    ops = [op_from_dict(d) for d in met.ops]
    if not same(ops):
        return met.ops, met.message, met.events  # not reproducible alone: kept as it ran
    best = minimize(ops, same, budget_s=budget_s)
    exc, session = outcome(best)
    return [op_to_dict(op) for op in best], str(exc), session.history.tail()


def known_entry(met, operations: list[dict], message: str, events: list[dict]) -> dict:
    d = met.defect
    return {"defect": d.id, "title": d.title, "category": d.category, "count": met.count,
            "first_example": met.example, "seconds_to_first": met.seconds, "kind": met.kind,
            "message": message, "operations": operations, "events": events[-12:], "repro": None}


def as_dict(expectations: Expectations | None) -> dict | None:
    if expectations is None:
        return None
    return {"path": str(expectations.path), "engine": expectations.table.engine,
            "version": expectations.table.version,
            "defects": [d.to_dict() for d in expectations.table.defects.values()]}


