"""Replaying a repro file: the same operations, a fresh session, no Hypothesis.

Everything a failure depends on is in the file (model settings, cache layout,
operations, mutant, faults), and the harness is deterministic, so a replay
either fails the same way or shows that the bug is gone.

Which implementation runs is decided here, never by code in the file: the
command line's ``--impl`` wins; otherwise the file's ``impl`` is used only when
it is a named adapter (``reference``, ``vllm``).  A ``module:Class`` written in
a file is imported only with ``--trust-impl``, because importing a module runs
its code and a repro file may come from anywhere (a CI artifact, an issue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.adapters import ENGINE_LEVEL, NAMED, resolve
from conformance.errors import ConformanceFailure, ImplementationError, ReproFormatError, UsageError
from conformance.harness.ops import op_to_dict
from conformance.harness.oracle import Oracle
from conformance.harness.session import make_session
from conformance.judge import standard_checkers
from conformance.model import TinyHybrid
from conformance.results.repro import Repro, operations_key
from conformance.suite.repro_setup import observers_of, prepare_factory


@dataclass
class ReplayOutcome:
    reproduced: bool
    impl: str
    mutant: str | None
    faults: list[str]
    kind: str | None = None
    message: str = ""
    failed_at: int | None = None  # index of the operation that failed
    applied: int = 0
    events: list[dict] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def choose_impl(repro: Repro, cli_impl: str | None, trust_impl: bool = False) -> str:
    if cli_impl:
        return cli_impl
    spec = repro.impl or repro.implementation
    if spec in NAMED:
        return spec
    if spec in ENGINE_LEVEL:
        raise UsageError(f"impl: {spec!r} is an engine-level target; cache-level repro files replay against "
                         f"{', '.join(sorted(NAMED))} or module:Class")
    if ":" in spec:
        if trust_impl:
            return spec
        raise UsageError(f"impl: the file names {spec!r}; importing it would run its code, so pass "
                         f"--impl {spec} (or --trust-impl) to replay against it")
    raise UsageError(f"impl: {spec!r} is not a named adapter ({', '.join(sorted(NAMED))}); pass --impl")


def choose_mutant(repro: Repro, impl: str, cli_impl: str | None,
                  cli_mutant: str | None) -> tuple[str | None, list[str]]:
    """The file's mutant was injected into the file's implementation: it applies
    unless the user names another mutant, ``none``, or another implementation."""
    notes: list[str] = []
    if cli_mutant is not None:
        return (None if cli_mutant == "none" else cli_mutant), notes
    file_impl = repro.impl or repro.implementation
    if repro.mutant and cli_impl and cli_impl != file_impl:
        notes.append(f"mutant {repro.mutant!r} was recorded against {file_impl!r}; not applied to {impl!r} "
                     f"(pass --mutant {repro.mutant} to force it)")
        return None, notes
    return repro.mutant, notes


def build_factory(impl: str, mutant: str | None, from_file: bool = False):
    """The implementation to replay on, the mutant applied (``from_file``: the
    file names it, so a mutant that does not fit is the file's error)."""
    factory = resolve(impl)
    if mutant:
        from conformance.suite.prepare import check_mutant_target
        from fault_injection.catalog import get_mutant

        try:
            found = get_mutant(mutant)
        except KeyError as exc:
            raise UsageError(f"mutant: {exc.args[0]}") from None
        # a mutant of another implementation would raise inside the replay (exit 3) or test nothing
        try:
            check_mutant_target(found, impl, factory, who=f"mutant {mutant!r}" if from_file else None,
                                said=impl if from_file else None)
        except UsageError as exc:
            raise (ReproFormatError(str(exc)) if from_file else exc) from None
        try:
            factory = found.wrap(factory)
        except TypeError as exc:
            raise UsageError(f"mutant {mutant}: {exc}") from None
    return factory


def check_repro(repro: Repro) -> None:
    """What the file names, checked before it runs, whatever this replay
    applies of it: a damaged file is exit 2 with the field, never a
    traceback (exit 1: "reproduced") nor a replay that cannot reproduce
    (exit 0: "not reproduced").  Its check must be one of this suite (a
    scenario names none), its mutant and faults registered ones (even when
    ``--mutant none`` or another ``--impl`` leaves them out: the file is wrong
    either way), its model one the harness can build, its pools ones it can
    allocate."""
    from conformance.suite.checks import get_check
    from conformance.suite.limits import memory_problem, model_problem

    if repro.check:
        try:
            get_check(repro.check)
        except KeyError as exc:
            raise ReproFormatError(f"check: {exc.args[0]}") from None
    if repro.mutant:
        from fault_injection.catalog import get_mutant

        try:
            get_mutant(repro.mutant)
        except KeyError as exc:
            raise ReproFormatError(f"mutant: {exc.args[0]}") from None
    if repro.faults:
        from fault_injection.environment import build_faults

        try:
            build_faults(tuple(repro.faults), repro.seed)
        except KeyError as exc:
            raise ReproFormatError(f"faults: {exc.args[0]}") from None
    why = model_problem(repro.model)
    if why:
        raise ReproFormatError(f"model.{why}" if why.split(":")[0].isidentifier() else f"model: {why}")
    c = repro.impl_config
    why = memory_problem(repro.model, c.block_size, c.num_kv_blocks, c.num_state_slots)
    if why:
        raise ReproFormatError(f"impl_config: {why}")


def _build_faults(names: list[str], seed: int):
    if not names:
        return None
    try:
        from fault_injection.environment import build_faults
    except ImportError:
        raise UsageError(f"faults: {', '.join(names)} recorded, but this harness has no environment "
                         f"faults (fault_injection.environment); pass --no-faults to replay without them") from None
    try:
        return build_faults(tuple(names), seed)
    except KeyError as exc:
        raise UsageError(f"faults: {exc.args[0]}") from None


def replay(repro: Repro, cli_impl: str | None = None, cli_mutant: str | None = None, trust_impl: bool = False,
           use_faults: bool = True, timeout: float | None = 30.0, model: TinyHybrid | None = None,
           keep_events: bool = False) -> ReplayOutcome:
    """Apply the file's operations to a fresh session.  Raises UsageError for
    what cannot run here, ReproFormatError for operations the session rejects.
    ``keep_events``: the whole history in ``events`` (else its tail)."""
    check_repro(repro)
    impl = choose_impl(repro, cli_impl, trust_impl)
    mutant, notes = choose_mutant(repro, impl, cli_impl, cli_mutant)
    # Faults travel with the mutant: "--mutant none" or another implementation
    # means "the clean implementation", so the file's faults are dropped too.
    dropped = cli_mutant == "none" or bool(cli_impl and cli_impl != (repro.impl or repro.implementation))
    faults = list(repro.faults) if use_faults and not dropped else []
    if repro.faults and not faults:
        notes.append(f"faults {', '.join(repro.faults)} not applied")
    factory = build_factory(impl, mutant, from_file=cli_mutant is None)
    prepare_factory(factory, repro)
    env = _build_faults(faults, repro.seed)
    if model is None or model.config != repro.model:
        model = TinyHybrid(repro.model)
    outcome = ReplayOutcome(False, impl, mutant, faults, notes=notes)
    from conformance.harness.disagg.ops import is_disagg

    if any(is_disagg(op) for op in repro.operations):  # the disagg family's operations: two workers
        from conformance.suite.disagg import replay_disagg

        return replay_disagg(repro, factory, model, outcome, timeout=timeout, keep_events=keep_events)
    session = None
    try:
        # The check's own retention checkers judge too (a retention or hit-rate
        # failure is theirs, not the logits'), exactly as during the run.
        session = make_session(factory, repro.impl_config, model, Oracle(model),
                               standard_checkers(observers_of(repro.check)), timeout=timeout)
        if env is not None:
            env.attach(session)
        for i, op in enumerate(repro.operations):
            try:
                session.apply(op)
            except ValueError as exc:  # the session refused the operation: the file is wrong, not the cache
                raise ReproFormatError(f"{operations_key(repro.version)}[{i}]: {exc}") from None
            outcome.applied = i + 1
    except (ConformanceFailure, ImplementationError) as exc:
        outcome.reproduced = True
        outcome.kind = exc.kind
        outcome.message = str(exc)
        outcome.failed_at = outcome.applied if session is not None else None
    if session is not None:
        outcome.events = session.history.as_data() if keep_events else session.history.tail()
        outcome.coverage = dict(session.coverage)
    return outcome


@dataclass
class RepeatedReplay:
    """A ``nondeterministic`` repro replayed several times, each in a fresh
    session: such a failure is, by its kind, one that one replay need not
    repeat, so one replay that passes proves nothing and one that fails meets
    the first failure, not the kind the file records.  What the runs show:
    whether they still differ from one another (the implementation still
    does not repeat itself) and whether the recorded first failure recurred."""

    outcomes: list[ReplayOutcome]
    recorded: tuple[str, str] | None  # the first failure the file records (kind, message); None: none recorded

    def recurred(self, outcome: ReplayOutcome) -> bool:
        """Whether ``outcome`` is the recorded first failure (kind and title), or any failure when none is recorded."""
        if not outcome.reproduced:
            return False
        return self.recorded is None or _same(self.recorded[0], self.recorded[1], outcome)

    def outcomes_differ(self) -> str:
        """How the first run and the first run that ended otherwise differ (failed or not, how, where), or "":
        the failure the kind records (one run fails, the same operations again do not) met again."""
        from conformance.results.defects import title_of

        def key(o: ReplayOutcome) -> tuple:
            return o.reproduced, o.kind, title_of(o.kind, o.message), o.failed_at

        first = self.outcomes[0]
        other = next(((i, o) for i, o in enumerate(self.outcomes[1:], start=2) if key(o) != key(first)), None)
        return f"run 1 {_said(first)}, run {other[0]} {_said(other[1])}" if other else ""

    def plans_differ(self) -> str:
        """Where two runs that ended alike planned otherwise, or "": the implementation does not repeat
        itself on these operations even where no run failed (a failure may need more runs to meet)."""
        first = _plans(self.outcomes[0])
        for i, o in enumerate(self.outcomes[1:], start=2):
            plans = _plans(o)
            if plans != first:
                at = next(n for n, (a, b) in enumerate(zip([*first, None], [*plans, None])) if a != b)
                return f"runs 1 and {i} planned otherwise from plan {at + 1} on"
        return ""


def _said(o: ReplayOutcome) -> str:
    if not o.reproduced:
        return "passed"
    return f"failed ({o.kind}) " + (f"at operation {o.failed_at + 1}" if o.failed_at is not None
                                    else "building the implementation")


def _plans(outcome: ReplayOutcome) -> list[dict]:
    return [e for e in outcome.events if e.get("event") == "plan"]


def replay_repeatedly(repro: Repro, runs: int, **kw) -> RepeatedReplay:
    """Replay a ``nondeterministic`` repro ``runs`` times (``kw``: as :func:`replay`), each in a fresh
    session of the same process (state an implementation keeps across instances stays, as it did in the run
    that found it), keeping each run's whole history to compare their plans."""
    from conformance.suite.verdict import first_failure

    outcomes = [replay(repro, keep_events=True, **kw) for _ in range(runs)]
    return RepeatedReplay(outcomes, first_failure(repro.failure.get("message") or ""))


def same_failure(repro: Repro, outcome: ReplayOutcome) -> bool:
    """Whether a replay that failed failed as the file recorded: the same kind
    and, where the file records a message, its title (within the replay's) (the message with
    numbers and request ids replaced: ``results.defects.title_of``).  Another
    failure (an engine that timed out while being built, a new problem on the
    way) is not the recorded one reproducing.  A file that records no failure
    (a hand-written scenario without one) is reproduced by any failure."""
    if not outcome.reproduced:
        return False
    return _same(repro.failure.get("kind"), repro.failure.get("message"), outcome)


def _same(kind: str | None, message: str | None, outcome: ReplayOutcome) -> bool:
    from conformance.results.defects import title_of

    if kind and kind != outcome.kind:
        return False
    # The recorded title within the replay's: a hand-written file may record the start of a message
    # ("schedule() did not return") where the replay names more (the class, the seconds it waited).
    if not message:
        return True
    recorded, got = title_of(kind, message), title_of(outcome.kind, outcome.message)
    return recorded.partition(": ")[2] in got.partition(": ")[2]


def witness(repro: Repro, outcome: ReplayOutcome) -> str:
    """The minimal story of the failure: the operations (the failing one marked),
    the last plans and verdicts before it, and the message."""
    lines = [f"FAILED ({outcome.kind}) at operation {outcome.failed_at + 1 if outcome.failed_at is not None else '-'}"
             f" of {len(repro.operations)}: {outcome.message}", "", "operations:"]
    for i, op in enumerate(repro.operations):
        mark = ">>" if i == outcome.failed_at else "  "
        lines.append(f" {mark} {i + 1:>3}. {_short(op_to_dict(op))}")
    if outcome.events:
        lines += ["", "last plans and verdicts:"]
        for ev in outcome.events:
            if ev.get("event") == "plan":
                for r in ev["requests"]:
                    on = f" on {r['worker']}" if r.get("worker") else ""  # a disaggregated plan's worker
                    lines.append(f"    plan    {r['request_id']}{on} [{r['start']}, {r['end']}) "
                                 f"blocks={r['block_table']} slot={r['state_slot']} init={r['state_init']}"
                                 + (f"<-{r['state_source']}" if r.get('state_source') is not None else "")
                                 + (f" snapshots={r['snapshots']}" if r.get('snapshots') else "")
                                 + (f" windows={r['window_tables']}" if r.get('window_tables') else ""))
                if ev.get("kv_copies") or ev.get("state_copies"):
                    lines.append(f"    copies  kv={ev.get('kv_copies')} state={ev.get('state_copies')}")
            elif ev.get("event") == "verdict":
                on = f" on {ev['worker']}" if ev.get("worker") else ""
                lines.append(f"    verdict {ev['request_id']}{on} [{ev['start']}, {ev['end']}) "
                             f"{'ok' if ev['ok'] else 'WRONG'} max_rel_error={ev['max_rel_error']:.3g}")
    return "\n".join(lines)


def _short(d: dict) -> str:
    d = dict(d)
    name = d.pop("op")
    if d.get("continues") is None:
        d.pop("continues", None)
    args = ", ".join(f"{k}={v}" for k, v in d.items())
    return f"{name}({args})"
