"""A hung implementation is abandoned once (issue 21, l): every later phase of
the check (building for the layout and the declared retention, Hypothesis's
replay of the failing example, the minimizer's replays, the pool probe's
calibration) would call it again and wait out the timeout each time (the
default 30 s made a hang cost about 120 s a check).  Counted by entries into
the hanging method, never by time."""

from __future__ import annotations

import time

import pytest

from conformance.adapters.reference import ReferenceCache
from conformance.adapters.reference.disagg import ReferenceDisagg
from conformance.contract import CacheView
from conformance.suite.options import RunOptions
from conformance.suite.single import run_single_check

ENTERED: dict[str, int] = {}


class HangsInSchedule(ReferenceCache):
    def schedule(self, budget):
        ENTERED["schedule"] = ENTERED.get("schedule", 0) + 1
        time.sleep(60)


class HangsWhenBuilt(ReferenceCache):
    def __init__(self, config=None):
        ENTERED["build"] = ENTERED.get("build", 0) + 1
        time.sleep(60)


class HangsOnLongPrompts(ReferenceCache):
    """Hangs only where the pool probe's calibration goes (a request of the
    whole pool), and states no refcounts, so that every example is probed."""

    def view(self):
        return CacheView()

    def add_request(self, request):
        if len(request.prompt) > 100:
            ENTERED["long"] = ENTERED.get("long", 0) + 1
            time.sleep(60)
        super().add_request(request)


class HangingDisagg(ReferenceDisagg):
    def schedule(self, budget=1 << 30):
        ENTERED["disagg"] = ENTERED.get("disagg", 0) + 1
        time.sleep(60)


class HangsInDisagg(ReferenceCache):
    """Its disaggregated mode hangs in schedule(): before, Hypothesis replayed
    the hanging example and the minimizer replayed it again (5 entries, about
    6x --timeout)."""

    disagg_factory = HangingDisagg


@pytest.mark.parametrize("factory,method,check", [
    (HangsInSchedule, "schedule", "mid-block-hits"),
    (HangsWhenBuilt, "build", "mid-block-hits"),
    (HangsWhenBuilt, "build", "retention-hit-rate"),  # the check also asks the declared retention
    (HangsOnLongPrompts, "long", "mid-block-hits"),
    (HangsInDisagg, "disagg", "disagg-transfer"),
])
def test_a_hang_costs_one_timeout_a_check(factory, method, check):
    ENTERED.clear()
    res = run_single_check(factory, check, RunOptions(examples=5, steps=6, seed=0, timeout=0.3, write_reports=False))
    assert res.status == "error" and res.failure.kind == "timeout", (res.status, res.failure)
    assert ENTERED[method] == 1, ENTERED
    if res.failure.operations:  # the result says why its repro was not minimized
        assert any(n.startswith("not minimized: the failure is a hang") for n in res.notes), res.notes


class RejectsRetentionOptions(ReferenceCache):
    """Declares no retention policy and refuses options it does not know (SGLang's adapter does)."""

    retention = None

    def __init__(self, config=None):
        if config is not None and {"interval", "admission"} & set(config.options):
            raise ValueError("unknown option(s) interval, admission")
        super().__init__(config)


def test_a_retention_check_skips_a_class_without_retention_before_building_it():
    """Building once for the layout and the declared retention must not build
    a class that declares no retention with the check's retention options
    (the SGLang adapter errored 'unknown sglang option(s) interval' instead
    of the check being skipped)."""
    res = run_single_check(RejectsRetentionOptions, "retention-hit-rate",
                           RunOptions(examples=2, steps=4, seed=0, write_reports=False))
    assert res.status == "skipped" and "declares no retention policy" in res.reason, (res.status, res.failure)
