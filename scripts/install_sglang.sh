#!/usr/bin/env bash
# Build a venv in which SGLang 0.5.23's own hybrid radix cache (UnifiedRadixCache, Full + Mamba)
# runs in-process on a CPU, beside this project installed editable (`--impl sglang`).
#
#   scripts/install_sglang.sh VENV_DIR
#
# Why this shape (measured, see docs/sglang-adapter.md and the SGLang notes):
# - sglang's wheel declares ~78 unconditional requirements, many CUDA-only (flashinfer, flash-attn,
#   sglang-kernel, cuda-python, ...), and pins torch==2.14.1.  `pip install sglang` cannot work on a
#   CPU, so: torch (the local +cpu wheel), then sglang with --no-deps, then the minimal set its
#   import chain (unified_radix_cache -> schedule_batch -> server stack) actually needs.
# - triton must be the real package: sglang.srt.utils.common imports it at module load and a stub
#   breaks torch.utils.flop_counter.  No kernel ever runs (supports_triton is False on a CPU).
# - torchvision is NOT installed: its PyPI build breaks beside torch +cpu; the adapter installs an
#   import stub instead (conformance/adapters/sglang/cpu_shim.py).
# - A separate venv, not .venvs/main: vLLM 0.33.0 there pins torch 2.14.0 and its own transformers;
#   sglang needs transformers==5.19.0 and would move them.
# Idempotent: re-running over an existing venv only re-checks the pins.  Exits non-zero on failure.
set -euo pipefail

VENV=${1:?usage: install_sglang.sh VENV_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3.11}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
start=$(date +%s)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel

# 1. torch: the local +cpu wheel where the machine has one; PyPI's CPU build name otherwise.
"${PIP[@]}" install -q "torch==${TORCH_VERSION}" || "${PIP[@]}" install -q "torch==${TORCH_VERSION}+cpu"

# 2. sglang alone, and compressed-tensors alone (its own deps would move torch).
"${PIP[@]}" install -q --no-deps "sglang==${SGLANG_VERSION}" "compressed-tensors==0.18.0"

# 3. the minimal import-chain set (torch pinned on every line so nothing moves it).
"${PIP[@]}" install -q "torch==${TORCH_VERSION}" \
    numpy msgspec orjson psutil pybase64 requests packaging pillow starlette triton zstandard xxhash \
    pydantic pyzmq tqdm ipython aiohttp "apache-tvm-ffi==0.1.11" "transformers==5.19.0" dill \
    sentencepiece loguru gguf "openai==2.8.0" partial_json_parser

# 4. this repo, editable, with its test extras (hypothesis, pytest).
"${PIP[@]}" install -q "torch==${TORCH_VERSION}" -e "$REPO[test]"

# 5. smoke: the hybrid cache imports on this CPU (through the adapter's shim) and says its version.
cd "$REPO"
HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PY'
from conformance.adapters.sglang import cpu_shim
cpu_shim.install()
import torch, sglang
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
print("torch", torch.__version__, "sglang", sglang.__version__)
PY
end=$(date +%s)
echo "installed into $VENV in $((end - start)) s, size $(du -sh "$VENV" | cut -f1)"
