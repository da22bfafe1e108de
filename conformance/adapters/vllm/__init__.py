"""The vLLM adapter (``--impl vllm``): vLLM's real v1 ``Scheduler`` and hybrid
KV cache manager, with the harness as the model runner.

vLLM is an optional dependency.  Importing this package without it raises an
ImportError that says how to install it, so ``--impl vllm`` fails with a clear
usage message instead of a traceback deep inside the adapter.
"""

from __future__ import annotations

import os

# vLLM refuses to build a VllmConfig on a machine without a GPU unless told
# the device; the adapter only runs the scheduler, which is device-agnostic.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the vLLM adapter needs vLLM 0.30.0 to 0.33.0: pip install vllm==0.33.0 (or pip install -e '.[vllm]', "
        f"or bash scripts/install_vllm.sh VENV VERSION); importing it failed with: {exc}") from exc

from conformance.adapters.vllm import compat  # noqa: E402

# Before any import that meets vLLM's internals: a release outside the checked
# ones is refused with the range (an ImportError: ``--impl vllm`` makes it a
# usage error, exit 2), not met as an error at some depth of the first check.
compat.require_supported()

from conformance.adapters.vllm.adapter import VllmCache  # noqa: E402

__all__ = ["VllmCache"]
