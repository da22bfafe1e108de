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
                 options: dict | None = None, mutant: str | None = None, expectations: str | None = None):
    """A pytest test function running ``check`` (a check id or a variant id such
    as ``mid-block-hits[prefix_match_unit=1]``) against ``impl_factory`` with
    ``examples`` Hypothesis examples of ``steps`` Hypothesis steps each, and
    rendering its verdict as the CLI and the pytest plugin do: it fails with
    the check's witness for a NEW failure (wrong logits, a broken invariant, a
    situation that never occurred...), is an xfail naming them when the
    check's only failures are known defects of the implementation's
    expectations file (a named adapter's, or ``expectations``), and a skip
    when the check cannot run.  As the CLI does, it first replays each open
    defect's pinned repro: one that no longer reproduces fails the test
    (FIXED: update the file), one that fails otherwise too (CHANGED: NEW).
    The test function keeps the check's last
    :class:`~conformance.results.records.CheckResult` as ``last_result``,
    its verdict as ``last_verdict`` and the run's
    :class:`~conformance.results.records.RunVerdict` as ``last_run_verdict``."""
    from conformance.suite.single import execute_single_check

    def run_test():
        import pytest

        # The CLI's core, whole (conformance.suite.run.execute): the pinned replays and judge_run included.
        result = execute_single_check(impl_factory, check, RunOptions(
            examples=examples, steps=steps, seed=seed, impl_options=dict(options or {}), mutant=mutant,
            expectations=expectations))
        res, run_verdict = result.checks[0], result.verdict
        assert run_verdict is not None, "execute() judges every run"
        verdict = run_verdict.check(res.id)
        run_test.last_result = res  # type: ignore[attr-defined]
        run_test.last_verdict = verdict  # type: ignore[attr-defined]
        run_test.last_run_verdict = run_verdict  # type: ignore[attr-defined]
        # A pinned repro that stopped reproducing is red whatever the check found: the plugin's strict
        # pinned-repro items and the CLI's FIXED say so, and the expectations file must be updated.
        red = [_pinned_text(p, result.implementation_version) for p in run_verdict.pinned
               if p.outcome in ("fixed", "changed")]
        if red:
            raise AssertionError("\n".join([*red, run_verdict.headline()]))
        assert verdict is not None
        if verdict.status == "skipped":
            pytest.skip(f"{check}: {res.reason}")
        if verdict.status in ("known", "expected"):
            what = f"known defects {', '.join(verdict.defects)}" if verdict.status == "known" else "expected failure"
            pytest.xfail(f"{check}: {what}: {verdict.why}")
        if verdict.status == "unexpected-skip":
            raise AssertionError(f"{check} skipped ({res.reason}), but the expectations file expects a result")
        if verdict.status == "unexpected-pass":
            raise AssertionError(f"{check} passed, but the expectations file expects a failure: update the file")
        if res.status != "passed":
            assert res.failure is not None
            raise AssertionError(f"{check} {res.status} ({res.failure.kind}): {res.failure.message}")

    run_test.__name__ = f"test_conformance_{check.replace('-', '_')}"
    return run_test


def _pinned_text(p, version: str) -> str:
    """A pinned repro's red outcome, in the plugin's words (pytest_plugin.PinnedReproItem)."""
    if p.outcome == "fixed":
        return (f"FIXED: {p.defect}: its pinned repro ({p.repro}) no longer reproduces on {version}: update the "
                f"expectations file (status = \"fixed in {version}\")")
    return f"CHANGED: {p.defect}: its pinned repro now fails otherwise: {p.why}"
