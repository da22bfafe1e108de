"""The README's "Writing an adapter" example runs, as written, under the harness."""

import re
from pathlib import Path

from conformance.contract import ImplConfig
from conformance.harness.ops import Drain, Submit
from conformance.judge import judged_session

README = Path(__file__).resolve().parent.parent / "README.md"


def _example_namespace():
    text = README.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class NoCache" in b)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)  # our own README, not user input
    return ns


def test_readme_adapter_is_correct(model, oracle):
    NoCache = _example_namespace()["NoCache"]
    s = judged_session(NoCache, ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=8), model, oracle)
    s.apply(Submit("a", tuple(range(1, 11)), 2))
    s.apply(Submit("b", tuple(range(1, 7)), 3))
    s.apply(Drain(5))
    s.apply(Submit("c", tuple(range(1, 11)), 1))
    s.apply(Drain(1024))
    assert s.coverage["prefix_hits"] == 0 and s.coverage["decode_steps"] > 0
    assert not s.active()


def test_machine_test_enforces_coverage_as_run_does():
    """The README's NoCache never hits a prefix: ``machine_test`` must fail
    mid-block-hits on coverage (as ``run`` does), not pass it."""
    import pytest

    from conformance.testing import machine_test

    NoCache = _example_namespace()["NoCache"]
    test = machine_test(NoCache, check="mid-block-hits", examples=5, steps=6)
    with pytest.raises(AssertionError, match=r"mid-block-hits failed \(coverage\).*mid_block_hits\b.*stayed at 0"):
        test()
    # A check that cannot run against it (no second tier) is a pytest skip with the reason, not a pass.
    with pytest.raises(pytest.skip.Exception, match="no second tier"):
        machine_test(NoCache, check="tier-reuse", examples=2, steps=4)()


def test_readme_speculative_adapter_verifies_drafts_correctly(model, oracle):
    """The README's speculative example: its verifications and the steps
    after them give reference logits; the spec family fails it on coverage
    only (a cache that never hits cannot reuse what speculation produced)."""
    import pytest

    from conformance.harness.ops import Draft, Step
    from conformance.testing import machine_test

    ns = _example_namespace()
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
                 if "class SpeculativeNoCache" in b)
    exec(compile(block, "README.md", "exec"), ns)
    Spec = ns["SpeculativeNoCache"]
    s = judged_session(Spec, ImplConfig(4, 32, 8, {"spec_tokens": 2}), model, oracle)
    s.apply(Submit("a", tuple(range(1, 10)), 10))
    s.apply(Step(1024))
    for count, agree in ((2, 2), (2, 0), (1, 1), (2, 1)):
        s.apply(Draft("a", count, agree))
        s.apply(Step(1024))
    s.apply(Drain(1024))
    assert [e["accepted"] for e in s.history.as_data() if e["event"] == "verified"] == [2, 0, 1, 1]
    assert not s.active()
    with pytest.raises(AssertionError, match=r"spec-decode failed \(coverage\).*hits_after_verify"):
        machine_test(Spec, check="spec-decode", examples=4, steps=6)()
