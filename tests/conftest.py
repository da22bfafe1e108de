import pytest
import torch

from conformance.harness.oracle import Oracle
from conformance.model import ModelConfig, TinyHybrid

# As every front door does: the tiny model's tensors only pay for intra-op threads
# (on a loaded machine, tens of times slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model():
    return TinyHybrid(ModelConfig())


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)


@pytest.fixture
def machine(monkeypatch, model):
    """A bound state machine driven by hand, rule by rule (Hypothesis's note()
    needs a test of its own): ``machine(check, factory=ReferenceCache,
    **options)``; options default to the check's, with its second tier on."""
    import random

    import conformance.generate.rules.base as base
    from conformance.adapters.reference import ReferenceCache
    from conformance.generate.machine import HybridCacheMachine
    from conformance.suite.checks import get_check

    monkeypatch.setattr(base, "note", lambda *_: None)

    def build(check: str, factory=ReferenceCache, **options):
        spec = get_check(check)
        option = getattr(factory, "tier_option", None)
        tier = {option[0]: option[1]} if spec.tier and option else {}
        config = spec.impl_config(options={**spec.options, **tier, **options})
        m = HybridCacheMachine(factory, spec, model=model, impl_config=config)
        rng = random.Random(0)
        m.start(tuple(tuple(rng.randrange(64) for _ in range(config.block_size * (spec.max_prompt_blocks + 1)))
                      for _ in range(3)))
        return m

    return build


def pytest_terminal_summary(terminalreporter):
    """After a run that included the registry gate: what it exempts, and why (a skipped check is not a
    pass, and neither is an exempted one: the list is said out loud, docs/registry-gate.md)."""
    ran = any("test_registry_gate" in getattr(r, "nodeid", "")
              for reports in terminalreporter.stats.values() for r in reports if hasattr(r, "nodeid"))
    if not ran:
        return
    from registry_gate import EXEMPTIONS, exemption_lines

    lines = exemption_lines()
    terminalreporter.section(f"registry gate: {len(lines)} exempted ({EXEMPTIONS.relative_to(EXEMPTIONS.parents[1])})")
    for line in lines:
        terminalreporter.write_line(line)
