"""Adapters: named implementations and ``module:Class`` resolution."""

from __future__ import annotations

import importlib
import os
import sys

from conformance.contract import ImplFactory, missing_methods
from conformance.errors import UsageError

# Named adapters, imported lazily: vLLM is heavy and optional.
NAMED = {
    "reference": "conformance.adapters.reference:ReferenceCache",
    "vllm": "conformance.adapters.vllm:VllmCache",
    "sglang": "conformance.adapters.sglang:SglangCache",
}
ENGINE_LEVEL = {"vllm-engine"}


def resolve(spec: str) -> ImplFactory:
    """``reference``, ``vllm`` or ``module:Class`` -> a factory ``f(ImplConfig)``."""
    target = NAMED.get(spec, spec)
    if ":" not in target:
        raise UsageError(f"--impl {spec!r}: expected one of {', '.join(sorted({*NAMED, *ENGINE_LEVEL}))} or "
                         f"module:Class")
    module_name, _, attr = target.partition(":")
    _import_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            hint = (f" (looked in the current directory {os.getcwd()} and on sys.path: run from the directory "
                    f"that holds {module_name.split('.')[0]}, or add that directory to PYTHONPATH)")
        raise UsageError(f"--impl {spec}: cannot import {module_name}: {exc}{hint}") from None
    except Exception as exc:  # noqa: BLE001 - a module that fails on import is a usage problem too
        raise UsageError(f"--impl {spec}: importing {module_name} raised {type(exc).__name__}: {exc}") from None
    except SystemExit as exc:  # sys.exit() at import ends no run: the module cannot be imported (a Ctrl-C can)
        raise UsageError(f"--impl {spec}: importing {module_name} raised SystemExit({exc.code!r}): the module "
                         f"ends the process when imported") from None
    factory: object = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UsageError(f"--impl {spec}: {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"--impl {spec}: {attr} is not callable")
    if isinstance(factory, type):
        missing = missing_methods(factory)
        if missing:
            raise UsageError(f"--impl {spec}: {attr} does not meet the contract (missing {', '.join(missing)})")
    return factory


def _import_from_cwd() -> None:
    """Make a ``module:Class`` in the current directory importable, as
    ``python -m`` does: the ``hybrid-conformance`` script and pytest put their
    own directories first on ``sys.path``, not the user's."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.append(cwd)  # appended: a module in the current directory never shadows an installed one
