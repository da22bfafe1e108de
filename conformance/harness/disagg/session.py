"""A disaggregated session: one implementation, two workers, one transport,
one model and oracle.

Each step: the implementation's :class:`~.contract.DisaggPlan` is executed in
engine order -- tail zeroing, new transfers submitted, one transport tick
(posts a chunk of every transfer in flight, collects notices), then every
worker-tagged request step on its worker's memory -- and judged: logits
against the no-cache oracle at every computed position, and on the decode
side every byte read audited against provenance.  Notices reach the
implementation in the same step's result.  The first problem raises
:class:`conformance.errors.ConformanceFailure` with the transport named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from conformance.contract import Request
from conformance.disagg.contract import DECODE, PREFILL, DisaggLayouts, DisaggPlan, DisaggResult
from conformance.errors import ConformanceFailure, ContractError
from conformance.harness.oracle import TOLERANCE, Oracle
from conformance.model import TinyHybrid

from .faults import FaultSpec
from .worker_runner import run_step
from .workers import Workers, build_workers, make_transport

MAX_DRAIN_STEPS = 200
IDLE_STEPS = 10

COUNTERS = ("steps", "requests", "transfers", "transfers_verified", "recomputes", "prefill_hits",
            "decode_steps", "mid_block_prompt_ends", "boundary_prompt_ends", "state_shards_transferred",
            "pairing_2to1", "pairing_1to2", "in_flight_reuse")


@dataclass
class _Track:
    tokens: list[int]
    prompt_len: int
    max_new: int
    generated: int = 0
    done: bool = False


@dataclass
class DisaggSession:
    impl: Any  # a disaggregated implementation (see .contract)
    model: TinyHybrid
    oracle: Oracle
    transport: str = "auto"
    faults: tuple[FaultSpec, ...] = ()
    reuse: Workers | None = None  # workers built earlier (memory and transport; never cleared)
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    log: list[str] = field(default_factory=list)
    applied: int = 0  # index of the operation being applied (a failure names it)

    def __post_init__(self) -> None:
        for m in ("disagg_layouts", "connect", "add_request", "schedule", "update", "abort"):
            if not callable(getattr(self.impl, m, None)):
                raise TypeError(f"{type(self.impl).__name__} is not a disaggregated implementation: no {m}()")
        self.layouts: DisaggLayouts = self.impl.disagg_layouts()
        self._own_workers = self.reuse is None
        if self.reuse is None:
            tr, self.transport_why = make_transport(self.transport, self.faults)
            self.workers: Workers = build_workers(self.layouts, self.model.config, tr)
        else:
            self.workers = self.reuse
            tr, self.transport_why = self.workers.transport, "reused"
            tr.reset()
        self.transport_name = tr.name
        # reused workers: earlier sessions' fault events are theirs (own ones: the metadata
        # exchange's, a dtype mismatch, are this session's)
        self._events_from = len(tr.events) if self.reuse is not None else 0
        self.impl.connect(self.workers.handshake)
        self.tracks: dict[str, _Track] = {}
        p, d = self.layouts.prefill.state_shards, self.layouts.decode.state_shards
        self._pairing = "pairing_2to1" if p > d else "pairing_1to2" if d > p else None
        ptype = self.workers.prefill.geometry.layout.state_dtype
        # a float32 prefill state (the dtype-mismatch fault) rounds what prefill reads back
        self.prefill_oracle = self.oracle if ptype == "float64" else Oracle(self.model, TOLERANCE[torch.float32])

    @property
    def events(self):
        """The fault events of this session (a transport reused across sessions keeps all of them)."""
        return self.workers.transport.events[self._events_from:]

    def active(self) -> list[str]:
        """Requests submitted and not finished or aborted, in submission order."""
        return [rid for rid, t in self.tracks.items() if not t.done]

    def in_flight(self) -> list[str]:
        """Requests whose transfer is in flight now (submitted, not every chunk posted)."""
        return [f.transfer.request_id for f in self.workers.transport._flights]

    def close(self) -> None:
        if self._own_workers:
            self.workers.close()

    def fail(self, kind: str, message: str):
        raise ConformanceFailure(kind, f"[{self.transport_name}] {message}")

    # -- operations ------------------------------------------------------------------------
    def submit(self, rid: str, prompt: tuple[int, ...], max_new: int = 2) -> None:
        self.tracks[rid] = _Track(list(prompt), len(prompt), max_new)
        self.coverage["requests"] += 1
        self.impl.add_request(Request(rid, tuple(prompt), max_new))

    def abort(self, rid: str) -> None:
        t = self.tracks.get(rid)
        if t and not t.done:
            t.done = True
            self.impl.abort(rid)

    def step(self) -> list[str]:
        plan = self.impl.schedule(1 << 30)
        if not isinstance(plan, DisaggPlan):
            self.fail("contract", f"schedule() returned {type(plan).__name__}, not DisaggPlan")
        self.coverage["steps"] += 1
        w = self.workers
        try:
            for z in plan.zero:
                w.of(z.worker).zero(z.offset, z.length)
            for t in plan.transfers:
                self._check_transfer(t)
                self._count_transfer(t)
                w.transport.submit(t)
            busy_pages = self._in_flight_pages()
            notices = w.transport.progress()
            sampled: dict[str, int] = {}
            for rs in plan.requests:
                self._run(rs, sampled, busy_pages)
        except ContractError as e:
            self.fail("contract", str(e))
        for n in notices:
            self.coverage["transfers_verified"] += int(n.ok and all(c.ok and c.src_digest == c.dst_digest
                                                                    for c in n.chunks))
        finished = self.impl.update(plan, DisaggResult(sampled, tuple(notices)))
        for rid, tok in sampled.items():
            self.tracks[rid].tokens.append(tok)
            self.tracks[rid].generated += 1
        for rid in finished:
            t = self.tracks[rid]
            if t.generated < t.max_new:
                self.fail("contract", f"{rid} reported finished after {t.generated} of {t.max_new} tokens")
            t.done = True
        return finished

    def _check_transfer(self, t) -> None:
        """Contract: a transfer's destination ranges are disjoint (two writes of the
        same bytes in one transfer have no defined order: NIXL posts them concurrently)."""
        if t.request_id not in self.tracks or self.tracks[t.request_id].done:
            self.fail("contract", f"transfer {t.id} for unknown or finished request {t.request_id}")
        spans = sorted((d.dst_offset, d.dst_offset + d.length) for c in t.chunks for d in c)
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1:
                self.fail("contract", f"transfer {t.id} ({t.request_id}): destination ranges [{a0}, {a1}) and "
                                      f"[{b0}, {b1}) overlap at {self.workers.decode.where(b0)}")

    def _count_transfer(self, t) -> None:
        self.coverage["transfers"] += 1
        tr = self.tracks[t.request_id]
        T = tr.prompt_len - 1
        for B in (self.layouts.prefill.block_size, self.layouts.decode.block_size):
            if T % B == 0:
                self.coverage["boundary_prompt_ends"] += 1
            else:
                self.coverage["mid_block_prompt_ends"] += 1

    def _in_flight_pages(self) -> set[int]:
        dg = self.workers.decode.geometry
        pages = set()
        for f in self.workers.transport._flights:
            pages |= {d.dst_offset // dg.page_bytes for c in f.transfer.chunks for d in c}
        return pages

    def _run(self, rs, sampled, busy_pages) -> None:
        t = self.tracks.get(rs.request_id)
        if t is None or t.done:
            self.fail("contract", f"step for unknown or finished request {rs.request_id}")
        assert t is not None
        if rs.worker not in (PREFILL, DECODE):
            self.fail("contract", f"{rs.request_id}: worker {rs.worker!r} (disaggregated steps name prefill or decode)")
        mem = self.workers.of(rs.worker)
        seq = tuple(t.tokens)
        ex = run_step(self.model, mem, rs, seq, tile_kernel=rs.worker == DECODE)
        oracle = self.prefill_oracle if rs.worker == PREFILL else self.oracle
        v = oracle.judge(seq, rs.start, ex.logits)
        if not v.ok:
            why = "; ".join(ex.problems) or "no stale byte found by the audit"
            self.fail("logits", f"{rs.request_id} on {rs.worker} [{rs.start}, {rs.end}): logits differ from the "
                                f"no-cache reference at position {v.first_bad_position} "
                                f"(max rel err {v.max_rel_error:.3g}); reads: {why}")
        if ex.problems:
            self.fail("invariant", f"{rs.request_id} on {rs.worker} [{rs.start}, {rs.end}): {ex.problems[0]}")
        if rs.worker == PREFILL:
            if rs.start > 0:
                self.coverage["prefill_hits"] += 1
        else:
            self.coverage["decode_steps"] += 1
            self.coverage["recomputes"] += int(rs.start == 0)
            if rs.start > 0 and rs.start == t.prompt_len - 1 and rs.state_init.kind == "resume" and self._pairing:
                # the first decode step read (and the audit passed) a state assembled from the other side's shards
                self.coverage["state_shards_transferred"] += max(self.layouts.prefill.state_shards,
                                                                 self.layouts.decode.state_shards)
                self.coverage[self._pairing] += 1
            if busy_pages - set(rs.block_table) - {rs.state_slot} and busy_pages:
                self.coverage["in_flight_reuse"] += 1
            if rs.end == len(seq) and t.generated < t.max_new:
                sampled[rs.request_id] = self.oracle.next_token(seq)

    def drain(self, max_steps: int = MAX_DRAIN_STEPS) -> None:
        """Steps until every request finished and no transfer is in flight; then idle
        steps (at most IDLE_STEPS) while the implementation still holds decode pages,
        as an engine keeps stepping while a receive it gave up on may still land."""
        tr = self.workers.transport
        for _ in range(max_steps):
            if all(t.done for t in self.tracks.values()) and not tr.in_flight() and not tr._held:
                break
            self.step()
        else:
            self.fail("stall", f"requests still running after {max_steps} steps: "
                               f"{[r for r, t in self.tracks.items() if not t.done]}")
        for _ in range(IDLE_STEPS):
            view = self.impl.view() if callable(getattr(self.impl, "view", None)) else None
            if not isinstance(view, dict) or not view.get("decode_used"):
                return
            self.step()

    def check_no_leak(self) -> None:
        """Once every request finished: the implementation holds no decode page and
        only cache entries on the prefill side (nothing leaked on either worker)."""
        view = self.impl.view() if callable(getattr(self.impl, "view", None)) else None
        if not isinstance(view, dict):
            return
        if view.get("decode_used"):
            self.fail("invariant", f"decode pages still held after every request finished: {view['decode_used']}")
        if view.get("running"):
            self.fail("invariant", f"requests still running after finishing: {view['running']}")
