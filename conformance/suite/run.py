"""The one core behind the CLI, the pytest plugin and the Python API:
``run()`` executes the checks of a profile against one implementation and
writes reports as it goes (an interrupted run keeps what finished)."""

from __future__ import annotations

from pathlib import Path

import torch

from conformance.errors import UsageError
from conformance.harness.oracle import Oracle
from conformance.judge.metrics import merge_summaries
from conformance.model import TinyHybrid
from conformance.results import report
from conformance.results.records import RunResult
from conformance.suite.checks import PROFILES, seed_index
from conformance.suite.config_matrix import expand
from conformance.suite.execute import check_faults_exercised, record_check, run_check
from conformance.suite.options import RunOptions, default_report_dir, now
from conformance.suite.prepare import prepare

__all__ = ["RunOptions", "run", "select_shard"]


def run(opts: RunOptions) -> RunResult:
    factory, name, specs, model_config, env = prepare(opts)
    # A check's seed comes from its position in the whole profile, so a shard,
    # a worker or a run of one --check draws exactly the examples the whole run would.
    profile = PROFILES[opts.profile]
    planned = [(seed_index(profile, spec.id, i), spec) for i, spec in enumerate(specs)]
    if opts.matrix:
        planned = expand(planned, factory, opts.impl_options)  # variants keep their check's index (seed)
    if opts.shard:
        planned = select_shard(planned, *opts.shard)
        if not planned:  # a green run of nothing would hide a miscounted CI matrix
            raise UsageError(f"--shard {opts.shard[0]}/{opts.shard[1]}: this shard holds no check (the run "
                             f"selects {len(specs)}); use at most {len(specs)} shards")
    # The model's tensors are tiny: intra-op threads only add synchronization,
    # which on a loaded CPU makes each step tens of times slower.
    torch.set_num_threads(1)
    model = TinyHybrid(model_config)
    oracle = Oracle(model)  # shared: the reference of a sequence never changes
    version = str(getattr(factory, "version", "unknown"))
    result = RunResult(implementation=name, implementation_version=version, seed=opts.seed, profile=opts.profile,
                       started=now(), model=model_config.to_dict(), mutant=opts.mutant,
                       impl_spec=opts.impl, fault_names=list(opts.faults),
                       implementation_build=str(getattr(factory, "build", "") or ""),
                       impl_config={"options": opts.impl_options, "block_size": opts.block_size,
                                    "num_kv_blocks": opts.num_kv_blocks, "num_state_slots": opts.num_state_slots})
    out = None
    if opts.write_reports:
        out = Path(opts.report_dir or default_report_dir(opts.impl, opts.seed, opts.mutant, opts.faults))
        out.mkdir(parents=True, exist_ok=True)
    notify = opts.progress or (lambda *a, **k: None)
    parallel = None
    try:
        if opts.workers > 1 and len(planned) > 1:
            from conformance.suite.parallel import run_parallel

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
        result.finished = now()
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


