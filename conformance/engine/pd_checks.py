"""The ``pd`` engine check family: prefill on one vLLM engine, decode on another, over vLLM's
own NixlConnector (:mod:`conformance.engine.pd`), judged like every engine check.

The decode side's tokens and logprobs go through :func:`conformance.engine.checks.judge`
(the cache-off engine and transformers, the calibrated tolerance policy of
:mod:`conformance.engine.tolerance`); this module adds the workload and the P/D coverage:
``pd_loads`` (requests whose decode side received the prefill's KV and recurrent state over
NIXL), ``pd_failed_loads``, ``prefill_hits`` (the prefill engine served part of the prompt
from its own prefix cache), ``decode_local_hits``, ``bytes_transferred``.

A check that moved nothing over NIXL tested nothing: it fails on coverage.
"""

from __future__ import annotations

import random
from dataclasses import replace

from conformance.engine.options import EngineOptions
from conformance.engine.pd import PdPair
from conformance.engine.trace import CachedEngine, Trace, run_workload
from conformance.engine.workloads import Req, Size, Workload, _toks, boundary_offsets
from conformance.errors import EngineError, FailureKind
from conformance.results.records import Failure

DESCRIPTION = ("prefill on a kv_producer engine, decode on a kv_consumer engine, KV and recurrent state "
               "moved by vLLM's NixlConnector (UCX, loopback): prompts ending mid-block and on a boundary, "
               "prefix hits on the prefill side, several decode tokens")


def pd_workload(rng: random.Random, B: int, vocab: int, size: Size, max_prompt: int = 0) -> Workload:
    """Round 0: fresh prompts whose lengths sit at k*B-1, k*B, k*B+1, k*B+B/2 (vLLM's prefill
    stops one token short for hybrid models, so these put the transferred prefix on both
    sides of a block boundary).  Round 1: new prompts sharing round 0's prompts as a prefix
    (the prefill engine hits its own cache; the decode engine may hit locally too, and loads
    only the rest).  Round 2: exact replays of round 0, in one call with a twin each.
    ``max_prompt``: the longest prompt the engines take (round 1 adds up to B tokens)."""
    lengths = sorted({k * B + off for k in size.ks for off in boundary_offsets(B) if k * B + off >= 2
                      and (not max_prompt or k * B + off + B <= max_prompt)})
    base = [_toks(rng, vocab, L) for L in lengths]
    yield [Req(f"pd L={len(p)}", p, size.max_tokens, expect_hit=True) for p in base]
    yield [Req(f"pd L={len(p)} extended", p + _toks(rng, vocab, rng.choice([1, B // 2, B])), size.max_tokens,
               expect_hit=True, shared=len(p)) for p in base]
    yield [Req(f"pd L={len(p)} replay{t}", p, size.max_tokens, expect_hit=True, shared=len(p))
           for p in base for t in ("", " twin")]


class PdCachedEngine(CachedEngine):
    """The plausibility bound of a P/D answer.  ``cached_tokens`` counts what the decode engine
    did not compute: its local hit plus what it loaded.  The load comes from the prefill engine,
    which was shown this very prompt in this call, so up to N-1 tokens are plausible; the decode
    engine's *local* hit is still bounded by what the decode engine was shown before
    (recorded here, checked by :func:`pd_coverage`)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.local_bounds: list[int] = []

    def hit_bound(self, prompt, round_prompts, me):
        self.local_bounds.append(super().hit_bound(prompt, round_prompts, me))
        return len(prompt) - 1


def pd_pair(v, opts: EngineOptions) -> PdPair:
    """Both sides get the variant's engine options; ``pd_prefill`` / ``pd_decode`` (dicts)
    override per side, e.g. ``{"block_size": 256}`` for heterogeneous block sizes."""
    side = replace(opts, pd_prefill=None, pd_decode=None)
    return PdPair(v.model, side, prefill_options=dict(opts.pd_prefill or {}),
                  decode_options=dict(opts.pd_decode or {}))


def run_pd_trace(cid: str, v, seed_rng: random.Random, size: Size, opts: EngineOptions) -> tuple[Trace, dict]:
    pair = pd_pair(v, opts)
    cached = PdCachedEngine(pair)
    info: dict = {}
    try:
        try:
            cached.ensure()
        except EngineError as e:
            return Trace(cid, "pd", error=e, error_round=-1), info
        assert pair.info is not None  # ensure() started the pair
        B = pair.info.block_size
        info = {"prefill": pair.info.extra.get("prefill", {}), "decode": pair.info.extra.get("decode", {}),
                "decode_block_size": B}
        max_prompt = opts.max_model_len - size.max_tokens
        assert opts.vocab_size is not None, "the run sets vocab_size from the model fixture"
        tr = run_workload(cid, "pd", cached, pd_workload(seed_rng, B, opts.vocab_size, size, max_prompt))
        info["transfers"] = pair.transfers
        tr.local_bounds = cached.local_bounds[:sum(len(o) for o in tr.outputs)]
        return tr, info
    finally:
        pair.close()


def pd_coverage(res, tr: Trace) -> None:
    """Adds the P/D counters to a judged result; fails it on coverage if nothing moved."""
    cov = res.coverage
    for k in ("pd_loads", "pd_failed_loads", "prefill_hits", "decode_local_hits", "external_tokens",
              "bytes_transferred"):
        cov.setdefault(k, 0)
    bounds = tr.local_bounds
    for i, (req, out, _) in enumerate(tr.requests()):
        c = getattr(out, "decode_connector", {}) or {}
        local = int(c.get("local_hit") or 0)
        if i < len(bounds) and local > bounds[i] and res.failure is None:
            res.status = "failed"
            res.failure = Failure(kind=FailureKind.CONTRACT, message=(
                f"{req.label}: the decode engine reports a local hit of {local} tokens, but no sequence it was "
                f"shown shares more than {bounds[i]} tokens with this prompt"), operations=tr.repro())
        cov["pd_loads"] += bool(getattr(out, "loaded", False))
        cov["pd_failed_loads"] += bool(c.get("recv_failed"))
        cov["prefill_hits"] += getattr(out, "prefill_cached", 0) > 0
        cov["decode_local_hits"] += bool(c.get("local_hit"))
        cov["external_tokens"] += int(c.get("external_tokens") or 0)
    # NIXL statistics are per call (one generate), not per request: summed over the rounds.
    seen_calls = set()
    for ri, outs in enumerate(tr.outputs):
        for out in outs[:1]:
            st = (getattr(out, "decode_connector", {}) or {}).get("stats") or {}
            if ri not in seen_calls:
                cov["bytes_transferred"] += int(st.get("bytes_transferred", 0))
                seen_calls.add(ri)
    if res.status == "passed" and tr.outputs and cov["pd_loads"] == 0:
        res.status = "failed"
        res.failure = Failure(kind=FailureKind.COVERAGE, message=(
            "no decode request received KV/state from the prefill engine over NIXL "
            f"({cov['pd_failed_loads']} failed loads): the P/D path was not exercised"), operations=tr.repro())
