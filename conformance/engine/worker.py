"""A subprocess that hosts one engine (vLLM) or one transformers reference.

Run as ``python -m conformance.engine.worker PROTOCOL_FD`` by the venv that has
vLLM.  Why a subprocess: an engine defect (an IndexError deep in a kernel, a
dead engine core, a segfault) must become a check result, not kill the run;
and the harness's own Python need not have vLLM or transformers.

Protocol: one JSON object per line on stdin; one JSON answer per line on the
file descriptor given as argv[1] (stdout is handed to the engine's logging,
which writes there).  Every answer has ``ok``; a failed command answers
``{"ok": false, "error": ..., "traceback": ...}`` and the worker goes on (the
parent decides whether to restart it).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from conformance.engine.vllm_host import VllmHost


class HfHost:
    def __init__(self, model_dir: str, options: dict):
        from conformance.engine.hf_forward import TransformersForward

        self.ref = TransformersForward(model_dir, compute_dtype=options.get("hf_compute_dtype", "float32"),
                                       device=options.get("device", "cpu"))
        import transformers

        self.info = {"version": transformers.__version__}

    def score(self, items: list[dict]) -> list[dict]:
        return [self.ref.score(it["tokens"], it["start"]).to_dict() for it in items]


def main() -> None:
    proto = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    # Everything else the engine prints goes to stderr (a log file the parent keeps).
    os.dup2(2, 1)
    host: Any = None  # VllmHost, PdHost or HfHost: each answers the commands of its kind
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "init":
                from conformance.engine.models import ensure_model, load_fixture

                fixture = load_fixture(msg["model"])
                model_dir = str(ensure_model(fixture, msg.get("cache_dir")))
                opts = dict(msg.get("options", {}))
                if msg["kind"] == "vllm":
                    opts.setdefault("dtype", fixture.dtype)
                    host = VllmHost(model_dir, opts)
                elif msg["kind"] == "vllm-pd":  # one side of a prefill/decode pair (pd_worker.py)
                    from conformance.engine.pd_worker import PdHost

                    opts.setdefault("dtype", fixture.dtype)
                    host = PdHost(model_dir, opts)
                else:
                    host = HfHost(model_dir, opts)
                ans = {"ok": True, "info": {**host.info, "model_dir": model_dir}}
            elif cmd == "generate":
                ans = {"ok": True, "outputs": host.generate(msg["prompts"], int(msg["max_tokens"]))}
            elif cmd == "generate_pd":
                ans = {"ok": True, "outputs": host.generate_pd(msg["prompts"], int(msg["max_tokens"]), msg["params"])}
            elif cmd == "score":
                ans = {"ok": True, "scores": host.score(msg["items"])}
            elif cmd == "exit":
                break
            else:
                ans = {"ok": False, "error": f"unknown command {cmd!r}"}
        except BaseException as e:  # an engine defect is data for the parent
            ans = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(ans) + "\n")
    proto.close()
    os._exit(0)  # skip engine teardown: it can hang, and nothing is left to save


if __name__ == "__main__":
    main()
