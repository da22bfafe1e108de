"""The one core behind the CLI, the pytest plugin and the Python API:
``run()`` executes the checks of a profile against one implementation and
writes reports as it goes (an interrupted run keeps what finished)."""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from . import report
from .adapters import UsageError, resolve
from .checks import PROFILES, CheckSpec, get_check
from .guard import ImplementationError, guarded
from .machine import Recorder, build_machine, hypothesis_settings, stable_draws
from .metrics import CacheMetrics, merge_summaries
from .model import ModelConfig, TinyHybrid
from .oracle import Oracle
from .results import CheckResult, Failure, RunResult
from .session import ConformanceFailure

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "fixtures" / "models" / "tiny-hybrid.toml"


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
    progress: object = None  # callable(event: str, **info)
    write_reports: bool = True
    stop_at_failure: bool = False  # skip the remaining checks once one fails (the mutants self-check)
    # "hypothesis": Hypothesis shrinks the failing example; "ops": it does not, and the failing
    # operations are minimized by replay instead (conformance/minimize.py: seconds, not minutes).
    shrink: str = "hypothesis"
    shard: tuple[int, int] | None = None  # (i, n), 1 <= i <= n: run every n-th check (CI runners)
    workers: int = 1  # processes on this machine (conformance.parallel)


def default_report_dir(impl: str, seed: int) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in impl)
    return Path("reports") / f"{stamp}-{safe}-s{seed}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def prepare(opts: RunOptions):
    """Resolve everything that can be wrong with the input before running
    anything, so that usage errors surface at once (exit code 2)."""
    if opts.profile not in PROFILES:
        raise UsageError(f"--profile {opts.profile!r}: expected one of {', '.join(PROFILES)}")
    opts.impl_options = dict(opts.impl_options)  # defaults set below must not leak into the caller's dict
    factory = resolve(opts.impl)
    try:
        specs = [get_check(c) for c in opts.checks] if opts.checks else list(PROFILES[opts.profile].checks)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    name = getattr(factory, "name", opts.impl)
    # How this implementation turns its second tier on, if it has one (an
    # optional class attribute: ("option", value)).
    tier_option = getattr(factory, "tier_option", None)
    if opts.mutant:
        from fault_injection import get_mutant

        try:
            mutant = get_mutant(opts.mutant)
        except KeyError as exc:
            raise UsageError(f"--mutant: {exc.args[0]}") from None
        try:
            factory = mutant.wrap(factory)
        except TypeError as exc:
            raise UsageError(f"--mutant {opts.mutant}: {exc}") from None
        for key, value in mutant.options:  # the configuration the buggy code path needs
            opts.impl_options.setdefault(key, value)
    env = None
    if opts.faults:
        from fault_injection.environment import build_faults

        try:
            env = build_faults(opts.faults, opts.seed)
        except KeyError as exc:
            raise UsageError(f"--faults: {exc.args[0]}") from None
        if tier_option:
            # Transfer faults need transfers, which implementations issue only
            # through their second tier: injecting faults turns it on.
            opts.impl_options.setdefault(*tier_option)
    model_config = opts.model_config or (ModelConfig.load(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else ModelConfig())
    return factory, name, specs, model_config, env


def run(opts: RunOptions) -> RunResult:
    factory, name, specs, model_config, env = prepare(opts)
    # The model's tensors are tiny: intra-op threads only add synchronization,
    # which on a loaded CPU makes each step tens of times slower.
    torch.set_num_threads(1)
    model = TinyHybrid(model_config)
    oracle = Oracle(model)  # shared: the reference of a sequence never changes
    version = str(getattr(factory, "version", "unknown"))
    result = RunResult(implementation=name, implementation_version=version, seed=opts.seed, profile=opts.profile,
                       started=_now(), model=model_config.to_dict(), mutant=opts.mutant,
                       impl_spec=opts.impl, fault_names=list(opts.faults),
                       impl_config={"options": opts.impl_options, "block_size": opts.block_size})
    out = None
    if opts.write_reports:
        out = Path(opts.report_dir or default_report_dir(opts.impl, opts.seed))
        out.mkdir(parents=True, exist_ok=True)
    profile = PROFILES[opts.profile]
    notify = opts.progress or (lambda *a, **k: None)
    # A check's seed comes from its position in the whole profile, so a shard
    # or a worker runs exactly the examples the unsplit run would.
    planned = list(enumerate(specs))
    if opts.shard:
        planned = select_shard(planned, *opts.shard)
    parallel = None
    try:
        if opts.workers > 1 and len(planned) > 1:
            from .parallel import run_parallel

            parallel = run_parallel(opts, planned, result, out, notify)
        for k, (index, spec) in enumerate(planned if parallel is None else ()):
            notify("check-start", check=spec.id, index=k, total=len(planned))
            res = run_check(factory, spec, model, oracle, opts, profile, index, env, notify)
            result.checks.append(res)
            record_check(out, result, res)
            notify("check-end", check=spec.id, result=res)
            if opts.stop_at_failure and res.status in ("failed", "error"):
                break
    except KeyboardInterrupt:
        result.interrupted = True
        raise
    finally:
        result.finished = _now()
        result.metrics = {"reference_runs": oracle.reference_runs,
                          "cache": merge_summaries([c.metrics for c in result.checks if c.metrics])}
        if opts.shard:
            result.metrics["shard"] = f"{opts.shard[0]}/{opts.shard[1]}"
        if parallel is not None:
            result.metrics.update(parallel.metrics())
        if env is not None and parallel is None:  # workers' faults were merged as they came
            result.faults = env.report()
        if result.faults and not result.interrupted:
            check_faults_exercised(result)
        if out is not None:
            report.write_all(out, result)
            result.metrics["report_dir"] = str(out)
    return result


def select_shard(planned: list, i: int, n: int) -> list:
    """Round-robin share ``i`` of ``n`` (1-based) of ``[(index, spec)]``:
    every check lands in exactly one shard, and neighbouring checks (which
    tend to cost alike) spread over the runners."""
    if not (isinstance(i, int) and isinstance(n, int) and 1 <= i <= n):
        raise UsageError(f"--shard {i}/{n}: expected i/n with 1 <= i <= n")
    return [item for k, item in enumerate(planned) if k % n == i - 1]


def record_check(out: Path | None, result: RunResult, res: CheckResult) -> None:
    """Write the repro and the reports after each check: a run killed later keeps this one."""
    if out is not None:
        if res.failure is not None:  # run_check records the configuration it failed under
            report.write_failure_repro(out, result, res, res.failure.impl_config)
        report.write_all(out, result)


def check_impl_config(spec: CheckSpec, opts: RunOptions, tier_option=None):
    tier = dict([tier_option]) if spec.tier and tier_option else {}
    return spec.impl_config(block_size=opts.block_size, options={**spec.options, **tier, **opts.impl_options})


def _declares_retention(factory, impl_config, timeout: float | None) -> bool:
    """Whether the implementation, built with this configuration, declares a
    retention policy (an engine may declare one for some settings only)."""
    if isinstance(factory, type) and not callable(getattr(factory, "retention", None)):
        return False
    try:
        impl = guarded("building the implementation", factory, impl_config, timeout=timeout)
        retention = getattr(impl, "retention", None)
        return callable(retention) and guarded("retention()", retention, timeout=timeout) is not None
    except ImplementationError:
        return True  # the check itself builds it again and reports the error, with context


def run_check(factory, spec: CheckSpec, model: TinyHybrid, oracle: Oracle, opts: RunOptions, profile,
              index: int, env=None, notify=lambda *a, **k: None) -> CheckResult:
    examples = opts.examples or profile.examples
    steps = opts.steps or profile.steps
    tier_option = getattr(factory, "tier_option", None)
    if spec.tier and not tier_option:
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           reason="the implementation has no second tier (no tier_option class attribute)")
    impl_config = check_impl_config(spec, opts, tier_option)
    if spec.observe and not _declares_retention(factory, impl_config, opts.timeout):
        return CheckResult(id=spec.id, family=spec.family, status="skipped", description=spec.description,
                           reason=f"the implementation declares no retention policy (optional retention() "
                                  f"method) for the options {impl_config.options}")
    recorder = Recorder(on_example=lambda r: notify("example", check=spec.id, examples=r.examples,
                                                    steps=r.steps, of=examples))
    cache_metrics = CacheMetrics()

    def wrap(session):
        cache_metrics.attach(session)
        if env is not None:
            env.attach(session)

    machine = build_machine(factory, spec, model, oracle, recorder, impl_config, timeout=opts.timeout, wrap=wrap)
    test = get_state_machine_test(machine, settings=hypothesis_settings(spec, examples, steps,
                                                                        shrink=opts.shrink != "ops"))
    test = hypothesis_seed(opts.seed * 1000 + index)(test)
    started = time.perf_counter()
    status, failure = "passed", None
    try:
        with stable_draws():
            test()
    except (ConformanceFailure, ImplementationError) as exc:
        status = "error" if isinstance(exc, ImplementationError) else "failed"
        steps_data, events = (recorder.failure[1], recorder.failure[2]) if recorder.failure else ([], [])
        first = recorder.first_failure or (None, None)
        failure = Failure(kind=exc.kind, message=str(exc), steps=steps_data, events=events[-12:],
                          examples_to_failure=first[0], seconds_to_failure=first[1])
        if opts.shrink == "ops" and steps_data:
            minimize_failure(failure, factory, spec, impl_config, model, oracle, opts, env)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a harness-side crash is reported, not swallowed silently
        status = "error"
        failure = Failure(kind="harness", message=f"{type(exc).__name__}: {exc}",
                          steps=recorder.failure[1] if recorder.failure else [])
    if status == "passed":
        missing = [c for c in spec.required if recorder.coverage.get(c, 0) == 0]
        if missing:
            status = "failed"
            failure = Failure(kind="coverage", message=f"the {spec.family} situation never occurred: "
                                                       f"{', '.join(missing)} stayed at 0 over {recorder.examples} examples")
    if failure is not None:
        failure.impl_config = asdict(impl_config)
    return CheckResult(id=spec.id, family=spec.family, status=status, description=spec.description,
                       examples=recorder.examples, steps=recorder.steps,
                       seconds=round(time.perf_counter() - started, 3), coverage=dict(recorder.coverage),
                       failure=failure, metrics=cache_metrics.summary())


def minimize_failure(failure: Failure, factory, spec: CheckSpec, impl_config, model, oracle, opts: RunOptions,
                     env=None) -> None:
    """Shorten ``failure.steps`` by replaying subsets (same failure kind), in place."""
    from .minimize import minimize, replay_fails
    from .ops import op_from_dict, op_to_dict

    def attach(session):
        if env is not None:
            env.attach(session)
        if getattr(spec, "observe", ()):
            from .retention import OBSERVERS

            session.observers.extend(OBSERVERS[name](session) for name in spec.observe)

    def outcome(ops):
        return replay_fails(factory, impl_config, model, oracle, ops, attach, timeout=opts.timeout)

    def still_fails(ops) -> bool:
        exc, _ = outcome(ops)
        return exc is not None and exc.kind == failure.kind

    ops = [op_from_dict(d) for d in failure.steps]
    if not still_fails(ops):
        return  # not reproducible by replay (it depended on state across examples): keep it as it is
    best = minimize(ops, still_fails)
    exc, session = outcome(best)
    failure.steps = [op_to_dict(op) for op in best]
    failure.message = str(exc)
    failure.events = list(session.history.events)[-12:]


def check_faults_exercised(result: RunResult) -> None:
    """A fault that never fired proves nothing: the run fails, as a check of its own."""
    idle = []
    for name, info in result.faults.items():
        info["exercised"] = bool(info.get("fired"))  # recomputed: workers' reports are merged by summing
        if not info["exercised"]:
            idle.append(name)
    if idle:
        hint = result.faults[idle[0]].get("hint", "")
        result.checks.append(CheckResult(
            id="faults-exercised", family="fault-injection", status="failed",
            description="every injected environment fault fired at least once",
            failure=Failure(kind="coverage", message=f"faults never fired: {', '.join(idle)}" + (f" ({hint})" if hint else ""))))
