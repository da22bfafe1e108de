"""The Python API for an adapter's own test suite (as ``zarr.testing`` is for
stores): the state machine that takes the implementation under test, and a
pytest-collectable test that runs one check with the same requirements as
``hybrid-conformance run`` (the same prepared run: coverage enforced, the tier
and retention options of the check, the check's seed, one intra-op thread).

    from conformance.testing import machine_test
    test_my_cache_mid_block = machine_test(MyCache, check="mid-block-hits", examples=50)
"""

from __future__ import annotations

from conformance.generate.machine import HybridCacheMachine
from conformance.suite.options import RunOptions

__all__ = ["HybridCacheMachine", "machine_test"]


def machine_test(impl_factory, check: str = "mixed", examples: int = 50, steps: int = 20, seed: int = 0,
                 options: dict | None = None, mutant: str | None = None):
    """A pytest test function running ``check`` (a check id or a variant id such
    as ``mid-block-hits[prefix_match_unit=1]``) against ``impl_factory`` with
    ``examples`` Hypothesis examples of ``steps`` Hypothesis steps each; it
    fails with the check's witness (wrong logits, a broken invariant, a
    situation that never occurred...).  The test function keeps the
    check's last :class:`~conformance.results.records.CheckResult` as
    ``last_result``."""
    from conformance.suite.single import run_single_check

    def run_test():
        res = run_single_check(impl_factory, check, RunOptions(examples=examples, steps=steps, seed=seed,
                                                               impl_options=dict(options or {}), mutant=mutant))
        run_test.last_result = res  # type: ignore[attr-defined]
        if res.status == "skipped":
            import pytest

            pytest.skip(f"{check}: {res.reason}")
        if res.status != "passed":
            assert res.failure is not None
            raise AssertionError(f"{check} {res.status} ({res.failure.kind}): {res.failure.message}")

    run_test.__name__ = f"test_conformance_{check.replace('-', '_')}"
    return run_test
