"""Benchmark of the prefill -> decode transports: real NIXL (UCX, two
processes on loopback) against the in-process copy transport, measured side
by side in one run, plus what the disagg family's general scenario costs on
each.

Three measurements per transport:

- ``wire``: the bare post of one handle (NIXL: create, post, wait, release),
  for a request-sized descriptor list (the reference's KV + state descriptors
  of a 63-token prompt, 2-shard/16-token prefill -> 1-shard/32-token decode)
  and for one large contiguous range (bandwidth);
- ``harness``: whole transfers through the harness transport (chunks,
  digests, provenance ledger, notifications), as the suite runs them;
- ``scenario``: ``ops.GENERAL`` through a judged DisaggSession (model and oracle
  included): the family's per-example cost.

    python bench/disagg_transport.py [--repeat 200] [--big-mib 16]

Prints a table and the NIXL / in-process ratio per row.  Never asserted.
"""

from __future__ import annotations

import argparse
import time

import torch

from conformance.adapters.reference.disagg import DisaggRequest, ReferenceDisagg
from conformance.contract import ImplConfig
from conformance.disagg.contract import DECODE, PREFILL, Descriptor, DisaggLayouts, DisaggTransfer, WorkerLayout
from conformance.harness.disagg import ops
from conformance.harness.disagg.workers import build_workers, make_transport
from conformance.harness.oracle import Oracle
from conformance.judge.disagg import judged_disagg_session
from conformance.model import ModelConfig, TinyHybrid


def request_descriptors(w) -> tuple[tuple[Descriptor, ...], tuple[Descriptor, ...]]:
    ref = ReferenceDisagg(ImplConfig(options=ops.PAIRINGS["2to1"]))
    ref.P, ref.D = w.prefill.geometry, w.decode.geometry
    r = DisaggRequest("bench", [0] * 64, 64, 1, p_blocks=[0, 1, 2, 3], d_blocks=[0, 1])
    return ref.kv_descriptors(r, 63), ref.state_descriptors(4, 2)


def measure(kind: str, repeat: int, big_mib: int, model: TinyHybrid, oracle: Oracle) -> dict:
    pages = max(16, (big_mib << 20) // 32768 + 2)
    layouts = DisaggLayouts(WorkerLayout(PREFILL, 16, pages, 2), WorkerLayout(DECODE, 32, pages, 1))
    tr, why = make_transport(kind)
    w = build_workers(layouts, model.config, tr)
    out = {"name": tr.name, "why": why}
    try:
        w.prefill.buf.copy_(torch.randint(0, 256, (w.prefill.buf.numel(),), dtype=torch.uint8))
        kv, state = request_descriptors(w)
        descs = kv + state
        nbytes = sum(d.length for d in descs)
        tr._post("WRITE", descs, b"warm")  # the first post sets up the connection
        for label, op, ds in (("wire request WRITE", "WRITE", descs), ("wire request READ", "READ", descs)):
            t = time.perf_counter()
            for i in range(repeat):
                tr._post(op, ds, f"w{i}".encode() if op == "WRITE" else b"")
            dt = time.perf_counter() - t
            out[label] = (repeat / dt, nbytes * repeat / dt, len(ds))
        big = min(big_mib << 20, w.prefill.geometry.buffer_bytes, w.decode.geometry.buffer_bytes)
        reps = max(3, repeat // 20)
        t = time.perf_counter()
        for i in range(reps):
            tr._post("WRITE", (Descriptor(0, 0, big),), b"big%d" % i)
        dt = time.perf_counter() - t
        out["wire 1 range WRITE"] = (reps / dt, big * reps / dt, 1)
        n = max(10, repeat // 4)
        t = time.perf_counter()
        got = 0
        for i in range(n):
            tr.submit(DisaggTransfer(1000 + i, "bench", (kv, state), "WRITE"))
            while True:
                notices = tr.progress()
                if notices:
                    got += sum(x.ok for x in notices)
                    break
        dt = time.perf_counter() - t
        out["harness request"] = (n / dt, nbytes * n / dt, len(descs))
        out["ok"] = got == n
    finally:
        w.close()
    t = time.perf_counter()
    s = judged_disagg_session(ReferenceDisagg, ImplConfig(options=ops.PAIRINGS["2to1"]), model, oracle, kind)
    try:
        for op in ops.GENERAL:
            s.apply(op)
    finally:
        s.close()
    out["scenario s"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--big-mib", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as every front door does: the tiny model only pays for intra-op threads
    model = TinyHybrid(ModelConfig())
    oracle = Oracle(model)
    oracle.prime(tuple(range(8)))
    results = {k: measure(k, a.repeat, a.big_mib, model, oracle) for k in ("inprocess", "nixl")}
    base, nixl = results["inprocess"], results["nixl"]
    print(f"transports: {base['name']}  |  {nixl['name']} ({nixl['why']})")
    print(f"{'measurement':24} {'descs':>5} {'in-process/s':>13} {'MiB/s':>9} {'NIXL/s':>10} {'MiB/s':>9} "
          f"{'NIXL/in-proc':>12}")
    for row in ("wire request WRITE", "wire request READ", "wire 1 range WRITE", "harness request"):
        (bt, bb, nd), (nt, nb, _) = base[row], nixl[row]
        print(f"{row:24} {nd:5d} {bt:13.1f} {bb / 2**20:9.1f} {nt:10.1f} {nb / 2**20:9.1f} {nt / bt:12.2f}")
    print(f"{'GENERAL scenario (s)':24} {'':5} {base['scenario s']:13.2f} {'':9} {nixl['scenario s']:10.2f} {'':9} "
          f"{nixl['scenario s'] / base['scenario s']:12.2f}")
    print(f"all harness transfers verified: in-process {base['ok']}, NIXL {nixl['ok']}")


if __name__ == "__main__":
    main()
