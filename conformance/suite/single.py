"""One check against an implementation object (a class, not a ``--impl``
string): what :func:`conformance.testing.machine_test` and the pytest plugin's
fixture run.  The same execution as ``hybrid-conformance run`` (coverage
enforced, the check's tier and retention options, one intra-op thread), so a
green test means what a green run means."""

from __future__ import annotations

import torch

from conformance.harness.oracle import Oracle
from conformance.model import TinyHybrid
from conformance.results.records import CheckResult
from conformance.suite.checks import PROFILES, get_check
from conformance.suite.execute import run_check
from conformance.suite.options import RunOptions, default_model_config


def run_single_check(factory, check_id: str, opts: RunOptions, model: TinyHybrid | None = None,
                     oracle: Oracle | None = None) -> CheckResult:
    torch.set_num_threads(1)  # as run() does: the tiny model's tensors only pay for threads
    spec = get_check(check_id)
    model = model or TinyHybrid(opts.model_config or default_model_config())
    oracle = oracle or Oracle(model)
    profile = PROFILES[opts.profile]
    ids = [s.id for s in profile.checks]
    index = ids.index(check_id) if check_id in ids else len(ids)  # the CLI's seed for this check
    return run_check(factory, spec, model, oracle, opts, profile, index)
