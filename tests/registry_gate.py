"""The registry gate's walks (tests/test_registry_gate.py runs them; conftest.py prints what they exempt).

A kind of vLLM cache memory (a ``KVCacheSpec`` subclass), the manager that keeps it (a
``SingleTypeKVCacheManager`` subclass), a registered KV connector, and a capability an adapter declares are
each either *exercised* -- a configuration variant of the quick profile builds it, read back from what vLLM
constructs for that variant -- or exempted in ``fixtures/registry-exemptions.toml`` with a reason.  A new
spec, manager or connector in a vLLM release, or a capability nobody runs, then fails the gate instead of
going unchecked in silence (the gate of vLLM's own conformance RFC, vllm#53194, over connectors; here over
the three registries and the adapters).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from conformance.generate.spec import CheckSpec

ROOT = Path(__file__).resolve().parents[1]
EXEMPTIONS = ROOT / "fixtures" / "registry-exemptions.toml"
DOC = ROOT / "docs" / "registry-gate.md"
# The options of speculative decoding: a variant is built without them here.  vLLM inspects the draft
# model's config in a subprocess (30-100 s on a loaded machine, once per method); the draft changes the
# Mamba spec's num_speculative_blocks and the scheduler's lookahead, never which spec class, manager or
# connector the scheduler builds (tests/test_vllm_spec.py builds them whole).
SPEC_KEYS = ("spec_tokens", "spec_method", "spec_lookahead_hashes")


def exemptions() -> dict:
    with EXEMPTIONS.open("rb") as fh:
        return tomllib.load(fh)


def exemption_lines() -> list[str]:
    """Every exemption as one printable line: ``section / name: reason``."""
    out: list[str] = []

    def walk(prefix: str, table: dict) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                out.append(f"{prefix.rstrip('.')} / {key}: {value}")

    walk("", exemptions())
    return out


def quick_variants(factory) -> list[tuple[int, CheckSpec]]:
    """The quick profile's checks under the factory's configuration matrix, as ``run`` plans them."""
    from conformance.suite.checks import PROFILES
    from conformance.suite.config_matrix import expand

    return expand(list(enumerate(PROFILES["quick"].checks)), factory, {})


def variant_options(factory, spec: CheckSpec) -> dict:
    """The options a variant's implementation is built with: the check's, the variant's, and the
    implementation's own switch for the tier or speculative family (as suite/execute.py adds them)."""
    options = dict(spec.options)  # a variant's own (its model and pool are the check's: CheckSpec.model)
    for wanted, attr in ((spec.tier, "tier_option"), (spec.spec, "spec_option")):
        option = getattr(factory, attr, None)
        if wanted and option:
            options.setdefault(option[0], option[1])
    return options


# -- vLLM's registries -------------------------------------------------------------------------------

def _subclasses(cls) -> set:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def vllm_registry() -> dict[str, set[str]]:
    """What the installed vLLM registers: spec classes, manager classes, connector names."""
    import vllm.v1.core.single_type_kv_cache_manager as st
    import vllm.v1.kv_cache_spec_registry as reg
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_cache_interface import KVCacheSpec

    specs = _subclasses(KVCacheSpec) | set(reg._REGISTRY_KVCACHESPEC_LIST)
    managers = (_subclasses(st.SingleTypeKVCacheManager)
                | {m.manager_class for m in reg._REGISTRY_KVCACHESPEC_LIST.values()}
                | set(reg._REGISTRY_ROLE_MANAGERS.values()))
    return {"specs": {c.__name__ for c in specs}, "managers": {c.__name__ for c in managers},
            "connectors": set(KVConnectorFactory._registry)}


@dataclass
class Exercised:
    """What the variants built: each name with the first variant that built it."""

    specs: dict[str, str] = field(default_factory=dict)
    managers: dict[str, str] = field(default_factory=dict)
    connectors: dict[str, str] = field(default_factory=dict)
    outside_connectors: dict[str, str] = field(default_factory=dict)  # loaded by module path (the harness's own)

    def add_scheduler(self, variant: str, scheduler) -> None:
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            self.managers.setdefault(type(manager).__name__, variant)
            spec = manager.kv_cache_spec
            self.specs.setdefault(type(spec).__name__, variant)
            if isinstance(spec, UniformTypeKVCacheSpecs):
                for layer_spec in spec.kv_cache_specs.values():
                    self.specs.setdefault(type(layer_spec).__name__, variant)
        transfer = scheduler.vllm_config.kv_transfer_config
        if transfer is not None and transfer.kv_connector:
            target = self.outside_connectors if transfer.kv_connector_module_path else self.connectors
            target.setdefault(transfer.kv_connector, variant)


def vllm_exercised() -> Exercised:
    """Builds every distinct configuration the quick profile runs against vLLM (as the suite builds it:
    the check's pools and options) and reads back the schedulers vLLM constructed."""
    from conformance.adapters.vllm import VllmCache
    from conformance.adapters.vllm.disagg import VllmDisagg

    seen: set[str] = set()
    out = Exercised()
    for _index, spec in quick_variants(VllmCache):
        options = {k: v for k, v in variant_options(VllmCache, spec).items() if k not in SPEC_KEYS}
        key = f"{spec.disagg}:{spec.model}:{spec.num_kv_blocks}:{sorted(options.items(), key=lambda kv: kv[0])!r}"
        if key in seen:
            continue
        seen.add(key)
        config = spec.impl_config(options=options)
        if spec.disagg:
            disagg = VllmDisagg(config)
            for side in (disagg.prefill, disagg.decode):
                out.add_scheduler(spec.id, side.scheduler)
        else:
            out.add_scheduler(spec.id, VllmCache(config).scheduler)
    _same_class_connectors(out)
    return out


def _same_class_connectors(out: Exercised) -> None:
    """A registered name whose loader gives the very class an exercised name loads is exercised too
    (``NixlConnector = NixlPullConnector``).  Only modules an exercised connector already imported are
    asked: importing another connector's module may build a CUDA extension (HF3FS)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = KVConnectorFactory._registry

    def module_of(name: str) -> str | None:
        cells = registry[name].__closure__ or ()
        values = [c.cell_contents for c in cells]
        return next((v for v in values if isinstance(v, str) and "." in v), None)

    loaded = {module_of(n): registry[n]() for n in out.connectors if n in registry}
    classes = {registry[n]() for n in out.connectors if n in registry}
    for name in registry:
        if name not in out.connectors and module_of(name) in loaded and registry[name]() in classes:
            out.connectors[name] = f"the class of {', '.join(sorted(out.connectors))}"


# -- the adapters' declared capabilities -------------------------------------------------------------

def declared_capabilities(factory) -> dict[str, str]:
    """Capability -> what declares it, for the capabilities the harness acts on."""
    caps: dict[str, str] = {}
    if getattr(factory, "tier_option", None):
        caps["tier_option"] = f"tier_option = {factory.tier_option!r}"
    if getattr(factory, "spec_option", None):
        caps["spec_option"] = f"spec_option = {factory.spec_option!r}"
    if callable(getattr(factory, "retention", None)):
        caps["retention"] = "retention()"
    if getattr(factory, "disagg_factory", None) is not None:
        caps["disagg"] = f"disagg_factory = {getattr(factory.disagg_factory, '__name__', factory.disagg_factory)}"
    for key in getattr(factory, "config_matrix", None) or {}:
        caps[f"config_matrix[{key}]"] = "a key of config_matrix"
    return caps


def exercising_variant(factory, capability: str) -> str | None:
    """The first variant of the quick profile that exercises the capability, or None."""
    planned = [spec for _index, spec in quick_variants(factory)]
    if capability.startswith("config_matrix["):
        key = capability[len("config_matrix["):-1]
        matrix = factory.config_matrix
        if key == "*":  # the checks whose id and family have no entry of their own
            hit = [s for s in planned if s.id.partition("[")[0] not in matrix and s.family not in matrix]
        else:
            hit = [s for s in planned if key in (s.family, s.id.partition("[")[0])]
        return hit[0].id if hit else None
    wanted = {"tier_option": lambda s: s.tier, "spec_option": lambda s: s.spec,
              "retention": lambda s: bool(s.observe), "disagg": lambda s: s.disagg}[capability]
    hit = [s for s in planned if wanted(s)]
    return hit[0].id if hit else None


def vllm_layers_exercised() -> dict[str, str | None]:
    """Each Mamba-layer spec the vLLM adapter builds (``layer``) -> the first variant that runs it."""
    from conformance.adapters.vllm import VllmCache
    from conformance.adapters.vllm.config import LAYERS, VllmOptions

    default = VllmOptions.__dataclass_fields__["layer"].default
    out: dict[str, str | None] = dict.fromkeys(LAYERS)
    for _index, spec in quick_variants(VllmCache):
        layer = variant_options(VllmCache, spec).get("layer", default)
        if out.get(layer) is None:
            out[layer] = spec.id
    return out
