"""Cache economics measured by replay: a workload runs through a real cache
implementation in a Session (the model computes, the oracle checks every
logit, the invariants run), and the harness counts what the cache stored and
reused from its plans and views -- no formula.

Definitions (the design note's section 3 units):

- *entry*: a distinct prefix whose recurrent state the cache admitted (seen in
  its view).  When the workload declares ``prefix_len``, only the declared
  prefixes count (the note's unit); ``states_stored`` always counts every
  distinct state admitted (prompt ends included).
- *hit*: a request whose first step started from a cached state -- at or past
  its declared prefix when it declares one.  ``state_hits`` counts every
  request that reused any state.
- ``hits_per_entry`` = hits / entries.

The cache is sized so that nothing is evicted (``evictions`` says so): the
figures are about admission, not capacity.

Under speculative decoding (``spec=(k, agree)``, the implementation's
``spec_option`` set to k): every decode step of the replay verifies k drafts
of which the first ``agree`` are the reference's next tokens (the harness is
the drafter), and the summary's ``speculation`` says how many were verified
and accepted.  The state hit rate is then the one under spec decode: a cache
that stops caching (or hitting) states when drafts are verified -- vllm#54360,
"any speculative method gives 0 hits on GDN" -- shows a collapsed state hit
rate beside a healthy KV hit rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from conformance.contract import ImplConfig
from conformance.generate.workload import WorkloadRequest
from conformance.harness.history import Verified
from conformance.harness.ops import Draft, Drain, Step, Submit
from conformance.harness.oracle import Oracle
from conformance.harness.session import make_session
from conformance.judge import standard_checkers
from conformance.judge.metrics import CacheMetrics
from conformance.model import ModelConfig, TinyHybrid


@dataclass
class Replay:
    workload: str
    impl: str
    options: dict
    block_size: int
    metrics: CacheMetrics
    result: dict = field(default_factory=dict)


def capacity(workload: list[WorkloadRequest], block_size: int, options: dict) -> tuple[int, int]:
    """(KV blocks, state slots) enough to keep every block and every
    checkpoint of a sequential replay: one state per checkpoint reached, one
    running slot, one block per B tokens (plus a copy-on-write block each)."""
    interval = options.get("interval")
    step = block_size if interval is None else interval
    blocks = slots = 8
    lengths: dict[str, int] = {}
    for r in workload:
        n = (lengths[r.continues] if r.continues else 0) + len(r.prompt) + len(r.append) + r.max_new_tokens
        lengths[r.id] = n
        blocks += -(-n // block_size) + 1
        slots += (n // step if step else 0) + 3
    return blocks, slots


def replay_workload(workload: list[WorkloadRequest], factory, options: dict | None = None, *, name: str = "workload",
           impl_name: str = "reference", block_size: int = 4, model_config: ModelConfig | None = None,
           keep_series: bool = False, timeout: float | None = None,
           spec: tuple[int, int] | None = None) -> Replay:
    options = dict(options or {})
    if spec is not None:
        option = getattr(factory, "spec_option", None)
        if not option:
            raise ValueError(f"{impl_name} has no speculative decoding (no spec_option)")
        options.setdefault(option[0], spec[0])
    # One intra-op thread: the tiny model's tensors are too small to split, and
    # on a loaded CPU thread synchronization alone makes each step ~50x slower.
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = TinyHybrid(model_config or ModelConfig())
    oracle = Oracle(model)
    blocks, slots = capacity(workload, block_size, options)
    config = ImplConfig(block_size=block_size, num_kv_blocks=blocks, num_state_slots=slots, options=options)
    metrics = CacheMetrics(keep_series=keep_series)
    session = make_session(factory, config, model, oracle, [*standard_checkers(), metrics], timeout=timeout)
    for r in workload:
        prompt = session.tracks[r.continues].tokens + r.append if r.continues else r.prompt
        session.apply(Submit(r.id, prompt, r.max_new_tokens, continues=r.continues))
        if spec is None:
            session.apply(Drain(1024))  # sequential: each request sees everything the previous ones left
        else:
            _drain_speculating(session, *spec)
    out = Replay(name, impl_name, options, block_size, metrics)
    out.result = summarize(workload, session, metrics)
    if spec is not None:
        out.result["speculation"] = speculation_summary(session, *spec)
    out.result.update(workload=name, impl=impl_name, interval=options.get("interval"),
                      admission=options.get("admission", "always"), block_size=block_size,
                      kv_blocks=blocks, state_slots=slots, seconds=round(time.perf_counter() - started, 2))
    return out


def _drain_speculating(session, k: int, agree: int) -> None:
    """Drain, proposing drafts before every step to each request in decode."""
    for _ in range(400):
        if not session.active():
            return
        for rid in session.active():
            if session.speculator.ready(session.tracks[rid]):
                session.apply(Draft(rid, k, agree))
        session.apply(Step(1024))
    raise RuntimeError("the speculative replay did not drain within 400 steps")


def speculation_summary(session, k: int, agree: int) -> dict:
    """What the replay verified, from the record (the oracle's acceptance)."""
    done = [e for e in session.history.events if isinstance(e, Verified)]
    drafts = sum(len(v.drafts) for v in done)
    accepted = sum(v.accepted for v in done)
    return {"tokens": k, "agree": agree, "verify_steps": len(done), "drafts": drafts, "accepted": accepted,
            "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0}


def summarize(workload: list[WorkloadRequest], session, metrics: CacheMetrics) -> dict:
    declared = [r for r in workload if r.prefix_len]
    starts = metrics.first_start
    if declared:
        prefixes = {r.prompt[: r.prefix_len] for r in declared}
        entries = len(prefixes & metrics.admitted)
        hits = sum(starts.get(r.id, 0) >= (r.prefix_len or 0) for r in declared)
        unit = "declared prefix"
    else:
        entries = len(metrics.admitted)
        hits = sum(s > 0 for s in starts.values())
        unit = "state"
    m = metrics.summary()
    return {
        "requests": len(workload),
        "entry_unit": unit,
        "entries_stored": entries,
        "hits": hits,
        "hits_per_entry": round(hits / entries, 4) if entries else 0.0,
        "states_stored": len(metrics.admitted),
        "state_hits": sum(s > 0 for s in starts.values()),
        "kv_hit_rate": m["kv_hit_rate"],
        "state_hit_rate": m["state_hit_rate"],
        "recomputed_no_state_tokens": m["recomputed_no_state_tokens"],
        "kv_occupancy_mean": m["kv_occupancy_mean"],
        "kv_occupancy_peak": m["kv_occupancy_peak"],
        "state_occupancy_mean": m["state_occupancy_mean"],
        "state_occupancy_peak": m["state_occupancy_peak"],
        "evictions": session.evicted,
        "prompt_tokens": m["prompt_tokens"],
        "reference_runs": session.oracle.reference_runs,
    }


def format_text(r: dict) -> str:
    pol = f"interval={'block' if r['interval'] is None else r['interval']}, admission={r['admission']}"
    return "\n".join([
        f"{r['workload']} on {r['impl']} ({pol}, block size {r['block_size']}): {r['requests']} requests "
        f"in {r['seconds']:.1f} s, logits checked against the no-cache oracle",
        f"  entries stored ({r['entry_unit']}s): {r['entries_stored']:,}   hits: {r['hits']:,}   "
        f"hits per stored entry: {r['hits_per_entry']:.2f}",
        f"  all states stored: {r['states_stored']:,}   requests reusing a state: {r['state_hits']:,}   "
        f"evictions: {r['evictions']}",
        f"  KV hit rate: {r['kv_hit_rate']:.3f}   state hit rate: {r['state_hit_rate']:.3f}   "
        f"tokens recomputed with no state where the KV could serve: {r['recomputed_no_state_tokens']:,}",
        f"  occupancy (mean / peak): KV {r['kv_occupancy_mean']:.3f} / {r['kv_occupancy_peak']:.3f}   "
        f"recurrent state {r['state_occupancy_mean']:.3f} / {r['state_occupancy_peak']:.3f}",
        *([_spec_line(r["speculation"])] if r.get("speculation") else []),
    ])


def _spec_line(sp: dict) -> str:
    return (f"  speculative decoding ({sp['tokens']} drafts a step, {sp['agree']} agreeing): {sp['verify_steps']:,} "
            f"verifications, {sp['accepted']:,} of {sp['drafts']:,} drafts accepted ({sp['acceptance_rate']:.3f}); "
            f"the hit rates above are under spec decode")


def plot(rep: Replay, path) -> str | None:
    """A PNG of the hit rates and occupancies over the replay; None when
    matplotlib (the optional ``plot`` extra) is missing, with the reason."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'hybrid-cache-conformance[plot]'): no plot written"
    s = rep.metrics.series
    x = [p["requests"] for p in s]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(x, [p["kv_hit_rate"] for p in s], label="KV hit rate")
    top.plot(x, [p["state_hit_rate"] for p in s], label="state hit rate")
    top.set_ylabel("cumulative hit rate (tokens)")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    bottom.plot(x, [p["kv_occupancy"] for p in s], label="KV blocks")
    bottom.plot(x, [p["state_occupancy"] for p in s], label="recurrent-state slots")
    bottom.set_ylabel("occupancy (pool sized for no eviction)")
    bottom.set_xlabel("requests replayed")
    bottom.legend(loc="upper left")
    r = rep.result
    fig.suptitle(f"{rep.workload}: interval={'block' if r['interval'] is None else r['interval']}, "
                 f"admission={r['admission']} ({r['entries_stored']} entries, {r['hits']} hits)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
