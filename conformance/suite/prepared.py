"""A run as prepared: everything decided before the first check runs.

:func:`conformance.suite.prepare.prepare_run` makes a :class:`Run` from the
user's :class:`~conformance.suite.options.RunOptions`, once; the CLI, the
pytest plugin, ``machine_test`` and every ``--workers`` process then run that
same object (a worker prepares it again from the same options, and gets the
same plan).  Nothing writes into it: what a run accumulates (the model's
reference cache, the faults' counters) lives in :class:`Resources`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.generate.spec import CheckSpec
from conformance.model import ModelConfig

if TYPE_CHECKING:
    from conformance.harness.oracle import Oracle
    from conformance.model import TinyHybrid
    from conformance.suite.checks import Profile
    from conformance.suite.known import Expectations
    from conformance.suite.options import RunOptions


@dataclass(frozen=True)
class PlannedCheck:
    """One entry of the plan: a check (or a configuration variant of one)."""

    position: int  # its place in this run's plan (reports keep this order)
    seed_index: int  # its check's index in the catalogue (conformance.suite.seeds)
    spec: CheckSpec

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass(frozen=True)
class PoolSizes:
    """``--block-size``, ``--kv-blocks``, ``--state-slots``: None keeps each check's own."""

    block_size: int | None = None
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None


@dataclass(frozen=True)
class Run:
    """A prepared run.  ``impl_options`` are the options every check's
    configuration gets on top of its own (the user's, then the mutant's and the
    tier option's defaults); ``checks`` is the plan: the selected checks,
    expanded under the configuration matrix and cut to the shard."""

    impl: str  # how the implementation was named: reference, vllm, module:Class
    factory: Callable[..., Any]  # builds the implementation (the mutant applied)
    name: str  # what the implementation calls itself
    version: str
    profile: Profile
    seed: int
    checks: tuple[PlannedCheck, ...]
    selected: int  # checks selected before the matrix and the shard (for messages)
    impl_options: Mapping[str, Any]
    tier_option: tuple[str, Any] | None  # how the implementation turns its second tier on
    spec_option: tuple[str, Any] | None  # how it turns speculative decoding on (the spec family needs it)
    mutant: str | None
    faults: tuple[str, ...]
    model_config: ModelConfig
    examples: int  # Hypothesis examples per check
    examples_asked: int | None  # --examples as given (the disaggregated family divides it by pairing)
    hypothesis_steps: int  # Hypothesis steps (rule calls) per example
    timeout: float
    shrink: str
    pools: PoolSizes
    report_dir: Path | None  # None: nothing is written
    workers: int
    shard: tuple[int, int] | None
    stop_at_failure: bool
    matrix: bool
    options: RunOptions  # what it was prepared from: a worker process prepares it again from these
    # The engine version's expectations file (known defects, per-check expectations: conformance.suite.known),
    # validated here; its known defects are recorded and explored past, never raised. None: no file.
    expectations: Expectations | None = None
    # The whole run's plan before the shard's cut (a shard records it: a merge tells a missing shard's checks).
    unsplit: tuple[str, ...] = ()
    # An engine-level run (--impl vllm-engine: conformance.suite.engine_level.EnginePlan): whole engines run
    # its checks, planned by id; ``checks`` is then empty.  None: a cache-level run.
    engine: Any = None

    @property
    def planned_ids(self) -> list[str]:
        """The ids of every check this run plans, in order (either level)."""
        return list(self.engine.planned) if self.engine is not None else [p.id for p in self.checks]


@dataclass
class Resources:
    """What the checks of a run share in one process and accumulate: the
    model, the oracle (the reference of a sequence never changes) and the
    environment faults (their counters add up over the checks)."""

    model: TinyHybrid
    oracle: Oracle
    faults: Any = None  # fault_injection.environment.FaultSet, or None
    # Models a check names (CheckSpec.model) and their oracles, built once a process.
    own: dict = field(default_factory=dict)

    def for_check(self, spec) -> Resources:
        """The resources of one check: the run's, with the check's own model
        and oracle when it names one (``CheckSpec.model``)."""
        if spec.model is None:
            return self
        if spec.model not in self.own:
            from conformance.harness.oracle import Oracle
            from conformance.model import ModelConfig, TinyHybrid

            model = TinyHybrid(ModelConfig.fixture(spec.model))
            self.own[spec.model] = Resources(model, Oracle(model), self.faults)
        return self.own[spec.model]


def resources_for(run: Run) -> Resources:
    """The model, oracle and faults of ``run`` in this process."""
    import torch

    from conformance.harness.oracle import Oracle
    from conformance.model import TinyHybrid

    # The model's tensors are tiny: intra-op threads only add synchronization,
    # which on a loaded CPU makes each step tens of times slower.
    torch.set_num_threads(1)
    model = TinyHybrid(run.model_config)
    env = None
    if run.faults:
        from fault_injection.environment import build_faults

        env = build_faults(run.faults, run.seed)  # validated by prepare_run
    return Resources(model=model, oracle=Oracle(model), faults=env)


def freeze_heap() -> None:
    """For a process that runs checks and then ends (the console's command, a
    ``--workers`` process): what it holds before its first check (the modules
    of torch, Hypothesis and the suite, about 200,000 objects) lives until it
    ends, so it leaves the cyclic garbage collector's generations
    (``gc.freeze``) and no full collection walks it again: hard-prefixes and
    kv-scarce spent 3% of their time in the collector, 1% frozen (2026-12-04;
    about 8% at ``1323528``, when the oracle kept a tensor view per prefix).
    Not for a process that goes on after the run (pytest): garbage left then
    would never be collected."""
    import gc

    gc.freeze()
