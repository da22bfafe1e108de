"""The options of one run, shared by the CLI, the pytest plugin and the Python API."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from conformance.errors import UsageError
from conformance.model import ModelConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-hybrid.toml"


def default_model_config() -> ModelConfig:
    """The model every run uses unless told otherwise (the fixture, when the checkout has it)."""
    return ModelConfig.load(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else ModelConfig()


class ProgressFn(Protocol):
    """Told of a run's progress: ``check-start`` (check, index, total), ``example``
    (check, examples, steps, of) and ``check-end`` (check, result)."""

    def __call__(self, event: str, **info: Any) -> None: ...


SHRINKS = ("ops", "hypothesis+ops", "hypothesis", "none")

# The longest an implementation call may be given (--timeout, seconds): a day.  A call allowed longer
# has no timeout worth the name, and the alarm that cuts a hang (harness/guard.py, setitimer)
# overflows on absurd values (1e308: "timestamp out of range"), after the run has started.
MAX_TIMEOUT = 86400.0


def timeout_problem(value) -> str | None:
    """Why ``value`` cannot be a call timeout in seconds (None when it can):
    a finite number above 0 and at most :data:`MAX_TIMEOUT`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_TIMEOUT
    return None if ok else f"must be a finite number above 0 and at most {MAX_TIMEOUT:g} (a day)"


@dataclass(frozen=True)
class RunOptions:
    """What the user asked for (the CLI's flags, the plugin's options, the
    Python API's arguments), before anything is resolved.  Never written
    into: :func:`conformance.suite.prepare.prepare_run` turns it into a
    frozen :class:`~conformance.suite.prepared.Run`, and every front door
    (CLI, pytest plugin, ``machine_test``, a ``--workers`` process) runs that."""

    # reference, vllm, module:Class -- or the implementation object itself (a
    # class or factory: the plugin's fixture form and machine_test pass one)
    impl: Any = "reference"
    profile: str = "quick"
    seed: int = 0
    report_dir: Path | None = None
    checks: tuple[str, ...] = ()  # empty: all checks of the profile
    mutant: str | None = None
    faults: tuple[str, ...] = ()
    timeout: float = 30.0  # per implementation call
    examples: int | None = None  # Hypothesis examples per check (--examples); None: the profile's
    # Hypothesis steps per example (--steps: rule calls, each of which applies
    # one or more operations); None: the profile's
    steps: int | None = None
    model_config: ModelConfig | None = None
    impl_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    num_kv_blocks: int | None = None  # override every check's pool sizes (--kv-blocks, --state-slots)
    num_state_slots: int | None = None
    progress: ProgressFn | None = None  # called with each event of the run
    write_reports: bool = True
    stop_at_failure: bool = False  # skip the remaining checks once one fails (the mutants self-check)
    # How a failure is minimized. "ops" (default): the failing operations are minimized by replay
    # (suite/minimize.py) until no single one can go: every repro is minimal, in seconds.
    # "hypothesis+ops": Hypothesis's shrinker first, then that (about 10x the time, the same length on
    # the shipped mutants). "hypothesis": Hypothesis's shrinker alone (it may leave inert operations,
    # such as a submit then abort of a request never scheduled). "none": the first failing example.
    shrink: str = "ops"
    shard: tuple[int, int] | None = None  # (i, n), 1 <= i <= n: run every n-th check (CI runners)
    workers: int = 1  # processes on this machine (conformance.suite.parallel)
    # Expand each check under the implementation's configuration matrix
    # (its ``config_matrix``; conformance.suite.config_matrix).
    matrix: bool = True
    # The expectations file (known defects, per-check expectations) the run is triaged against; by
    # default the one written for the implementation and its installed version (fixtures/expectations/).
    expectations: str | Path | None = None


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)


def default_report_dir(impl: str, seed: int, mutant: str | None = None, faults: tuple[str, ...] = (),
                       root: Path = Path("reports")) -> Path:
    """A new directory under ``root``, created here, named for the time, the
    implementation, the mutant and the faults, and the seed.  Two runs started
    in the same second get two directories (``.2``, ``.3``...): ``mkdir``
    without ``exist_ok`` is the reservation, so even two processes never share one."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    parts = [stamp, _safe(impl)]
    if mutant:
        parts.append(f"mutant-{_safe(mutant)}")
    if faults:
        parts.append(f"faults-{_safe('+'.join(faults))}")
    parts.append(f"s{seed}")
    base = Path(root) / "-".join(parts)
    base.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = base if n == 1 else base.with_name(f"{base.name}.{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def parse_options(pairs: list[str]) -> dict:
    """``["k=v", ...]`` (``--option``, ``--hybrid-option``) -> ``{k: v}``, values read as JSON when they parse."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        if key in out and out[key] != parsed:  # which one was meant? (the same value twice is harmless)
            raise UsageError(f"--option {key}: given twice, as {out[key]!r} and {parsed!r}")
        out[key] = parsed
    return out
