#!/usr/bin/env bash
# Install the project and one supported vLLM release (the CUDA wheel, run with VLLM_TARGET_DEVICE=cpu at the
# scheduler level) into a virtual environment of its own:
#
#   bash scripts/install_vllm.sh VENV VERSION [SHARE_WITH_VENV ...]     the release with the torch it pins
#   bash scripts/install_vllm.sh --on BASE_VENV VENV VERSION            the release's wheel alone, over BASE_VENV
#
#   bash scripts/install_vllm.sh .venvs/vllm-0.31.0 0.31.0
#   VLLM_TARGET_DEVICE=cpu .venvs/vllm-0.31.0/bin/hybrid-conformance run --impl vllm --profile quick
#
# - VERSION is one of the releases the adapter supports (conformance/adapters/vllm/compat.py: SUPPORTED;
#   tests/test_vllm_versions.py keeps this list equal to it); anything else is a usage error (exit 2).
# - vLLM is installed with the torch its wheel pins (0.30.0-0.32.0: torch 2.13.0, 0.33.0: 2.14.0), the CUDA
#   build from PyPI, which imports and runs on a CPU.  A machine whose pip configuration offers a local CPU
#   wheel of that torch (find-links with torch-2.13.0+cpu) would otherwise take it, and vLLM's torchvision,
#   built against the CUDA torch, then fails at import: "operator torchvision::nms does not exist".  So the
#   installs here run with no pip configuration file and no find-links (PyPI only; pip's cache is kept, so
#   a second version reuses the torch and CUDA wheels the first one downloaded).
# - Each environment is about 8.5 GB.  Environments named after it (SHARE_WITH_VENV: other vLLM envs on the
#   same file system) get their identical files (torch, the CUDA libraries: 0.30-0.32 pin the same ones)
#   hard-linked with the new one when util-linux's `hardlink` is there (measured: 5 GiB saved per extra
#   version).  pip never edits an installed file in place, so linked environments stay independent.
# - NIXL 1.5.1 (UCX) as the main environment has it (scripts/install_nixl.sh): the disagg-transfer check's
#   transport, so that a release is not judged on the in-process stand-in where 0.33.0 runs NIXL.
# - The project is installed editable from this checkout, with its test extras.
#
# --on BASE_VENV: only vLLM VERSION's wheel (--no-deps), in a venv that sees BASE_VENV's packages after its
#   own (a .pth calling site.addsitedir): BASE_VENV's torch, transformers, NIXL and editable project.  For the
#   scheduler level only: what runs there is vLLM's Python scheduler, KV cache manager, configs and
#   NixlConnector scheduler side, and none of its compiled code runs on a CPU in either environment
#   ("Failed to import from vllm._C: ModuleNotFoundError" in both).  About 850 MB and half a minute instead
#   of 8.5 GB and 5-15 minutes; scripts/test.sh (CI) runs an older release this way.  Not for the engine
#   level, and not a replacement for the full environment when writing a release's expectations
#   (docs/upgrading-vllm.md says which runs used which).
set -euo pipefail

usage() {
  echo "usage: install_vllm.sh VENV VERSION [SHARE_WITH_VENV ...] | --on BASE_VENV VENV VERSION" \
       "(VERSION: one of $SUPPORTED)" >&2
  exit 2
}
SUPPORTED="0.30.0 0.31.0 0.32.0 0.33.0"
BASE=""
if [ "${1:-}" = --on ]; then
  [ $# -eq 4 ] || usage
  BASE=$2
  shift 2
  [ -x "$BASE/bin/python" ] || { echo "install_vllm.sh: --on $BASE: no virtual environment there" >&2; exit 2; }
fi
[ $# -ge 2 ] || usage
VENV=$1
VERSION=$2
shift 2
case " $SUPPORTED " in
  *" $VERSION "*) ;;
  *) echo "install_vllm.sh: vLLM $VERSION is not supported by the adapter (supported: $SUPPORTED)" >&2; exit 2 ;;
esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3.11}
log() { printf '[install_vllm.sh %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$(date +%s)

parent=$(dirname "$VENV")
mkdir -p "$parent"

if [ -n "$BASE" ]; then
  base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path: BASE_VENV's own .pth files (the editable project) must run too.
  echo "import site; site.addsitedir('$base_site')" > "$site/_hcc_base_venv.pth"
  log "installing vllm==$VERSION's wheel alone (--no-deps) over $BASE"
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      --no-deps "vllm==$VERSION"
  VLLM_TARGET_DEVICE=cpu PYTHONPATH="$REPO" "$VENV/bin/python" - "$VERSION" <<'PY'
import sys
import vllm
assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
from conformance.adapters.vllm.compat import installed
import conformance.adapters.vllm  # the adapter's imports of vLLM's scheduler, KV cache manager and configs
print("vllm", vllm.__version__, "from", vllm.__file__, "build", installed().build)
PY
  log "installed vllm $VERSION over $BASE into $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
  exit 0
fi
free=$(df -Pk "$parent" | awk 'NR==2 {printf "%d", $4 / 1048576}')
[ "$free" -ge 12 ] || log "WARNING: $free GiB free under $parent; a vLLM environment takes about 11 GiB"

# PyPI only (see above); PIP_CERT and the like still apply.
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

log "installing vllm==$VERSION (with the torch it pins) into $VENV"
"${PIP[@]}" install -q "vllm==$VERSION"
log "installing NIXL (UCX, without a CUDA torch: scripts/install_nixl.sh) for the disagg family"
bash "$REPO/scripts/install_nixl.sh" "$VENV"
log "installing the project (editable, test extras) from $REPO"
"${PIP[@]}" install -q -e "$REPO[test]"
"${PIP[@]}" check

# What broke with the CPU torch: vLLM's torchvision ops, then the modules the adapter imports.
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$REPO" "$VENV/bin/python" - "$VERSION" <<'EOF'
import sys
import torch, torchvision
torchvision.ops.nms  # "operator torchvision::nms does not exist" under a CPU torch
import vllm
assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
from conformance.adapters.vllm.compat import installed
print("torch", torch.__version__, "vllm", vllm.__version__, "build", installed().build)
EOF

if [ $# -gt 0 ] && command -v hardlink >/dev/null 2>&1; then
  before=$(du -sk "$VENV" "$@" | awk '{s += $1} END {print s}')
  # -f: the same file name, -t: pip does not keep the wheels' timestamps, -s: skip small files (fast).
  hardlink -q -f -t -s 1M "$VENV" "$@" || log "WARNING: hardlink failed; the environments stay separate copies"
  after=$(du -sk "$VENV" "$@" | awk '{s += $1} END {print s}')
  log "hard-linked identical files with $*: $(( (before - after) / 1048576 )) GiB saved"
fi
log "installed vllm $VERSION into $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1) apparent)"
