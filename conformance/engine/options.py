"""The options of an engine-level run (``run --impl vllm-engine --option KEY=VALUE``,
``run_engine_checks(..., options)``), typed: every key is a field here, an
unknown key or a value of the wrong type is refused (a usage error, exit 2),
and the engine code reads attributes, never a dict.

Worker processes (the vLLM host, the transformers host) run in another
interpreter and receive their settings as JSON: :meth:`EngineOptions.for_worker`
builds that dict, the one place the wire format is made."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from conformance.errors import UsageError


@dataclass(frozen=True)
class EngineOptions:
    # -- where the engines run
    python: str | None = None  # the interpreter that has vLLM (else $HCC_VLLM_PYTHON, else .venvs/vllm-cpu)
    device: str = "cpu"  # cpu | cuda
    cache_dir: str | None = None  # where model fixtures are built
    env: Mapping[str, str] = field(default_factory=dict)  # more environment for the engine's worker
    # -- what runs (replacing the profile's)
    models: tuple[str, ...] = ()  # fixture names: one plain variant each
    families: tuple[str, ...] | None = None  # the workload families to run
    # -- the engine (vllm.LLM / EngineArgs); None: the engine's own default
    dtype: str | None = None  # default: the fixture's
    mamba_ssm_cache_dtype: str | None = None
    mamba_cache_mode: str | None = None
    mamba2_checkpoint_workaround: bool = False
    max_model_len: int = 1024
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    enable_chunked_prefill: bool | None = None
    prefix_caching: bool = True  # the P/D pair's; the single engines set it per role (cached / cache-off)
    # vLLM's speculative_config for the engine under test (the spec family sets it; the references never have it)
    speculative_config: Mapping[str, Any] | None = None
    # -- planted faults (the suite's self-check): fault for the cached engine, pd_fault for the P/D pair
    fault: str | None = None
    pd_fault: str | None = None
    # -- prefill/decode over vLLM's NixlConnector
    kv_connector: str | None = None
    kv_load_failure_policy: str | None = None
    kv_connector_extra_config: Mapping[str, Any] | None = None
    kv_buffer_device: str | None = None
    tensor_parallel_size: int | None = None
    distributed_executor_backend: str | None = None
    pd_prefill: Mapping[str, Any] | None = None  # per-side overrides of these options, e.g. {"block_size": 256}
    pd_decode: Mapping[str, Any] | None = None
    # -- judging
    eviction_blocks: int = 24  # KV blocks of the small-memory engine of the eviction family
    min_hit_share: float = 0.5
    skip_transformers: bool = False  # judge against the cache-off engine only
    exact: bool | None = None  # default: exact on a CPU, statistical on a GPU
    hf_compute_dtype: str = "float32"
    # -- set by the run from the model fixture, never by the user
    vocab_size: int | None = None
    fixture_dtype: str | None = None

    @classmethod
    def parse(cls, given: Mapping[str, Any] | EngineOptions | None) -> EngineOptions:
        """Options from a dict (``--option`` values, a profile's variant, a
        test): unknown keys and wrong types raise UsageError naming the key."""
        if isinstance(given, EngineOptions):
            return given
        return EMPTY.merged(given or {})

    def merged(self, more: Mapping[str, Any] | None) -> EngineOptions:
        """These options with ``more`` over them (a variant's, one side of a P/D pair)."""
        if not more:
            return self
        known = _FIELDS
        values = {}
        for key, value in more.items():
            if key not in known:
                raise UsageError(f"--option {key}: not an option of the vllm-engine adapter (known: "
                                 f"{', '.join(sorted(known))})")
            values[key] = _coerce(key, value, known[key])
        return replace(self, **values)

    @property
    def given(self) -> dict[str, Any]:
        """The options that differ from the defaults (what a report shows)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(EMPTY, f.name) and f.name != "python"}

    @property
    def judged_dtype(self) -> str:
        return self.dtype or self.fixture_dtype or "float32"

    @property
    def is_exact(self) -> bool:
        return self.exact if self.exact is not None else self.device == "cpu"

    def for_worker(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The settings ``keys`` that are set, as the JSON a worker process reads."""
        out = {}
        for key in keys:
            value = getattr(self, key)
            if value is not None and value != ():
                out[key] = dict(value) if isinstance(value, Mapping) else value
        return out


def _coerce(key: str, value, hint):
    """``value`` as the type of ``key``, or a UsageError.  From the CLI a list
    arrives as ``a,b``; JSON values arrive parsed."""
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise UsageError(f"--option {key}: must not be empty")
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    origin = typing.get_origin(base) or base
    if origin is tuple:
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise UsageError(f"--option {key}: must be a list of names (a,b), got {value!r}")
        return tuple(value)
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise UsageError(f"--option {key}: must be an object (JSON), got {value!r}")
        return dict(value)
    if base is bool:
        if not isinstance(value, bool):
            raise UsageError(f"--option {key}: must be true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"--option {key}: must be an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"--option {key}: must be a number, got {value!r}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise UsageError(f"--option {key}: must be a string, got {value!r}")
        return value
    return value


EMPTY = EngineOptions()
_FIELDS: dict[str, Any] = typing.get_type_hints(EngineOptions)
