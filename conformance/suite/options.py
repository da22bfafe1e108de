"""The options of one run, shared by the CLI, the pytest plugin and the Python API."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from conformance.model import ModelConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-hybrid.toml"


def default_model_config() -> ModelConfig:
    """The model every run uses unless told otherwise (the fixture, when the checkout has it)."""
    return ModelConfig.load(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else ModelConfig()


class ProgressFn(Protocol):
    """Told of a run's progress: ``check-start`` (check, index, total), ``example``
    (check, examples, steps, of) and ``check-end`` (check, result)."""

    def __call__(self, event: str, **info: Any) -> None: ...


@dataclass
class RunOptions:
    impl: str = "reference"
    profile: str = "quick"
    seed: int = 0
    report_dir: Path | None = None
    checks: tuple[str, ...] = ()  # empty: all checks of the profile
    mutant: str | None = None
    faults: tuple[str, ...] = ()
    timeout: float = 30.0  # per implementation call
    examples: int | None = None  # override the profile
    steps: int | None = None
    model_config: ModelConfig | None = None
    impl_options: dict = field(default_factory=dict)
    block_size: int | None = None
    progress: ProgressFn | None = None  # called with each event of the run
    write_reports: bool = True
    stop_at_failure: bool = False  # skip the remaining checks once one fails (the mutants self-check)
    # "hypothesis": Hypothesis shrinks the failing example; "ops": it does not, and the failing
    # operations are minimized by replay instead; "none": the first failing example as it came
    # operations are minimized by replay instead (conformance/minimize.py: seconds, not minutes).
    # None: the implementation's ``shrink`` class attribute, else "hypothesis".
    shrink: str | None = None
    shard: tuple[int, int] | None = None  # (i, n), 1 <= i <= n: run every n-th check (CI runners)
    workers: int = 1  # processes on this machine (conformance.suite.parallel)
    # Expand each check under the implementation's configuration matrix
    # (its ``config_matrix``; conformance.suite.matrix).
    matrix: bool = True


def default_report_dir(impl: str, seed: int) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in impl)
    return Path("reports") / f"{stamp}-{safe}-s{seed}"


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


