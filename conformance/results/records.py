"""Results of a run, as plain data (the boundary between running and reporting)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATUSES = ("passed", "failed", "error", "skipped")
SCHEMA_VERSION = 1
# Every kind a Failure can have (an expectations file names one of them).
# "noise": an engine check whose measured noise is above the documented ceiling (too noisy to judge).
FAILURE_KINDS = ("logits", "invariant", "contract", "stall", "retention", "hit-rate", "coverage", "noise",
                 "raised", "timeout", "harness")


@dataclass
class Failure:
    kind: str  # logits | invariant | contract | raised | timeout | stall | coverage
    message: str
    steps: list[dict] = field(default_factory=list)  # the minimized operation sequence (ops as data)
    events: list[dict] = field(default_factory=list)  # the last plans and verdicts before the failure
    repro: str | None = None  # path of the repro file, once written
    examples_to_failure: int | None = None  # examples run until the first failing one (before shrinking)
    seconds_to_failure: float | None = None
    impl_config: dict | None = None  # the configuration it failed under (a repro replays exactly that)


@dataclass
class CheckResult:
    id: str
    family: str
    status: str
    description: str = ""
    # The options of a configuration-matrix variant (its id names them too);
    # empty for a check run as the profile lists it.
    options: dict = field(default_factory=dict)
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    coverage: dict[str, int] = field(default_factory=dict)
    failure: Failure | None = None
    reason: str = ""  # for skipped checks
    metrics: dict = field(default_factory=dict)  # cache metrics measured during the check (judge/metrics.py)
    # What this verdict could not rest on, said rather than silently passed: a
    # checker that had nothing to check (no refcounts stated), a retention
    # policy the implementation declared instead of the one the check configured.
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    implementation: str
    implementation_version: str
    seed: int
    profile: str
    started: str
    finished: str | None = None
    interrupted: bool = False
    impl_spec: str = ""  # what --impl said (reference, vllm, module:Class)
    model: dict = field(default_factory=dict)
    impl_config: dict = field(default_factory=dict)
    mutant: str | None = None
    fault_names: list[str] = field(default_factory=list)
    faults: dict[str, dict] = field(default_factory=dict)  # fault name -> {"fired": n, ...}
    checks: list[CheckResult] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

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
                and not self.interrupted)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        d["coverage"] = self.coverage
        d["summary"] = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        d["summary"]["checked"] = self.checked
        d["summary"]["ok"] = self.ok
        d["summary"]["skip_reasons"] = {c.id: c.reason for c in self.checks if c.status == "skipped"}
        # Of the failures, those that are performance bugs (reuse below the declared
        # retention policy; logits were right): reported apart from correctness.
        d["summary"]["hit_rate_failures"] = sum(c.status == "failed" and c.failure is not None
                                                and c.failure.kind == "hit-rate" for c in self.checks)
        return d
