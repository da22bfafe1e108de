"""The registry gate: nothing in vLLM's cache registries, and no capability an adapter declares, goes
unchecked in silence.  Each is exercised by a configuration variant of the quick profile or exempted in
fixtures/registry-exemptions.toml with a reason (tests/registry_gate.py walks them; the exemptions are
printed at the end of every test run, and listed in docs/registry-gate.md)."""

from __future__ import annotations

import pytest
from registry_gate import (
    DOC,
    declared_capabilities,
    exemption_lines,
    exemptions,
    exercising_variant,
)


def _verdict(kind: str, have: set[str], exercised: dict[str, str], exempt: dict[str, str]) -> list[str]:
    problems = []
    for name in sorted(have - set(exercised) - set(exempt)):
        problems.append(f"{kind} {name}: neither exercised by a variant of the quick profile nor exempted (add "
                        f"a configuration variant that builds it, or a reason to fixtures/registry-exemptions.toml)")
    for name in sorted(set(exempt) & set(exercised)):
        problems.append(f"{kind} {name}: exempted ({exempt[name]!r}) but exercised by {exercised[name]}: "
                        f"remove the exemption")
    for name in sorted(set(exempt) - have):
        problems.append(f"{kind} {name}: exempted, but the installed vLLM has no such {kind}: remove the exemption")
    return problems


def test_every_exemption_has_a_reason_and_is_in_the_docs():
    lines = exemption_lines()
    assert lines
    doc = DOC.read_text()
    for line in lines:
        section, _, rest = line.partition(" / ")
        name, _, reason = rest.partition(": ")
        assert len(reason.strip()) >= 20, f"{section} {name}: a reason says why, in a sentence: {reason!r}"
        assert f"`{name}`" in doc, f"{section} {name} is exempted but docs/registry-gate.md does not list it"


def test_reference_capabilities_are_exercised():
    from conformance.adapters.reference import ReferenceCache

    _capabilities_gate("reference", ReferenceCache)


def _capabilities_gate(name: str, factory) -> None:
    exempt = exemptions().get("capabilities", {}).get(name, {})
    declared = declared_capabilities(factory)
    assert declared, f"{name} declares no capability the gate knows"
    exercised = {cap: by for cap in declared if (by := exercising_variant(factory, cap))}
    problems = _verdict("capability", set(declared), exercised, exempt)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def vllm_walk():
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    from registry_gate import vllm_exercised, vllm_registry

    exercised = vllm_exercised()  # first: building a scheduler registers vLLM's built-in specs
    return vllm_registry(), exercised


@pytest.mark.parametrize("kind", ["specs", "managers", "connectors"])
def test_vllm_registry_gate(vllm_walk, kind):
    registry, exercised = vllm_walk
    exempt = exemptions().get("vllm", {}).get(kind, {})
    problems = _verdict(kind[:-1], registry[kind], getattr(exercised, kind), exempt)
    assert not problems, "\n".join(problems)


def test_vllm_capabilities_and_spec_layers_are_exercised():
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    from registry_gate import vllm_layers_exercised

    from conformance.adapters.vllm import VllmCache

    _capabilities_gate("vllm", VllmCache)
    exempt = exemptions().get("capabilities", {}).get("vllm-layers", {})
    layers = vllm_layers_exercised()
    problems = _verdict("layer", set(layers), {k: v for k, v in layers.items() if v}, exempt)
    assert not problems, "\n".join(problems)


def test_the_gate_fails_on_what_it_does_not_know():
    """The verdict itself: an unknown name fails, a stale exemption fails, an exercised one passes."""
    have = {"A", "B", "C"}
    problems = _verdict("spec", have, {"A": "v1"}, {"B": "a reason long enough to say why", "D": "gone"})
    assert any("spec C: neither exercised" in p for p in problems)
    assert any("spec D: exempted, but the installed vLLM has no such spec" in p for p in problems)
    assert not any(p.startswith("spec A") or p.startswith("spec B") for p in problems)
    assert any("exercised by v1: remove" in p for p in _verdict("spec", have, {"A": "v1"}, {"A": "x"}))
