"""SglangCache: the harness contract on top of SGLang 0.5.23's own hybrid radix
cache (``UnifiedRadixCache`` with the FULL and MAMBA components), its
``HybridReqToTokenPool`` / Mamba slot allocator and its KV allocators.

Every caching decision is SGLang's: prefix matching (``Req.init_next_round_input``
-> ``match_kv_cache``), the copy-on-write slot choice, locking, allocation with
eviction (``alloc_for_extend`` / ``alloc_for_decode``), the extra_buffer track
cursor (``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``),
checkpointing into the tree (``checkpoint_kv_cache``) and release
(``release_kv_cache``).  The adapter performs the scheduler duties that glue
those calls together, and the model runner's duties (see the package docstring).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace

import sglang
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.mem_cache.allocation import alloc_for_decode, alloc_for_extend, ensure_mamba_capacity
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.runtime_context import mamba_track_grid
from sglang.srt.sampling.sampling_params import SamplingParams

from conformance.adapters.sglang.config import SglangOptions, build
from conformance.adapters.sglang.view import build_view
from conformance.contract import (
    FRESH,
    RESUME,
    ImplConfig,
    Layout,
    Request,
    RequestStep,
    StateInit,
    StepPlan,
    StepResult,
    copy_from,
)


@dataclass
class _Live:
    request: Request
    req: Req
    admitted: bool = False
    init: StateInit = FRESH  # state init of the first step after admission
    pending_checkpoint: bool = False  # a no_buffer fork waits for the next plan (see _flush_checkpoints)
    track: tuple | None = None  # (position, ping-pong index) the running step writes (extra_buffer)
    decode: bool = False  # the step in flight is a decode step
    hits: list = field(default_factory=list)


class _Batch(SimpleNamespace):
    """The fields of a one-request ``ScheduleBatch`` that SGLang's allocation
    functions read: the adapter calls SGLang's own ``alloc_for_extend`` /
    ``alloc_for_decode`` with it instead of re-implementing them."""

    def maybe_evict_swa(self):
        return None  # no SWA component

    def is_dllm(self):
        return False


class SglangCache:
    name = "sglang"
    version = sglang.__version__

    def __init__(self, config: ImplConfig | None = None):
        config = config or ImplConfig()
        self.config = config
        self.opts = SglangOptions.from_config(config)
        built = build(self.opts)
        self.cache, self.req_pool, self.allocator = built.cache, built.req_pool, built.allocator
        self.mamba_pool = self.req_pool.mamba_pool
        self.P = self.opts.page_size
        # The forward's mamba state copies land in the harness's memory, not in SGLang's
        # placeholder tensors: every copy SGLang asks its pool for is recorded here and
        # executed by the harness as a plan-level state copy, in order.
        self._copies: list[tuple[int, int]] = []
        pool_copy = self.mamba_pool.copy_from

        def copy_from_recorded(src, dst):
            for s, d in zip(torch.as_tensor(src).view(-1).tolist(), torch.as_tensor(dst).view(-1).tolist()):
                self._copies.append((int(s), int(d)))
            return pool_copy(src, dst)

        self.mamba_pool.copy_from = copy_from_recorded
        self.live: dict[str, _Live] = {}
        self.order: list[str] = []  # FCFS: waiting and running in arrival order
        self._fake_model = SimpleNamespace(is_encoder_decoder=False,
                                           hf_text_config=SimpleNamespace(mamba_chunk_size=self.opts.chunk))
        # SGLang's extra_buffer track planning for a prefill chunk (an attribute so a
        # fault-injection wrapper can replace it on one instance).
        self.prepare_track = ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend
        self.stats = {"steps": 0, "hit_tokens": 0, "lookups": 0, "forks": 0, "tracks": 0}

    # -- contract ------------------------------------------------------------------
    def layout(self) -> Layout:
        # One harness KV block per SGLang page (page 0 is the allocator's padding page);
        # one state slot per Mamba slot (slot 0 is never handed out).
        return Layout(self.P, self.opts.num_pages, self.opts.mamba_slots + 1)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.live:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        sp = SamplingParams(temperature=0, max_new_tokens=request.max_new_tokens, ignore_eos=True)
        req = Req(rid=request.request_id, origin_input_text="", origin_input_ids=array("q", request.prompt),
                  sampling_params=sp)
        self.live[request.request_id] = _Live(request, req)
        self.order.append(request.request_id)

    def schedule(self, budget: int) -> StepPlan:
        self.stats["steps"] += 1
        # SGLang asserts chunked_prefill_size % page_size == 0: the harness's token budget
        # stands for the chunk size, so it is rounded up to whole pages.
        budget = -(-max(1, int(budget)) // self.P) * self.P
        steps = []
        scheduled = set()
        # 1. Running requests first (decode, next prefill chunk), in arrival order.
        for rid in self.order:
            lv = self.live[rid]
            if not lv.admitted or budget <= 0:
                continue
            step = self._continue(lv, budget)
            if step is not None:
                steps.append(step)
                scheduled.add(rid)
                budget -= step.end - step.start
        # 2. Admission, FCFS: stop at the first request that does not fit (SGLang's PrefillAdder).
        for rid in self.order:
            lv = self.live[rid]
            if lv.admitted or budget <= 0:
                continue
            step = self._admit(lv, budget)
            if step is None:
                break
            steps.append(step)
            budget -= step.end - step.start
        copies, self._copies = tuple(self._copies), []
        if not steps and copies:
            self._copies = list(copies)  # the harness runs no copies without a step: keep them
            copies = ()
        return StepPlan(requests=tuple(steps), state_copies=copies)

    def update(self, plan: StepPlan, result: StepResult) -> list[str]:
        finished = []
        for step in plan.requests:
            lv = self.live[step.request_id]
            req = lv.req
            if lv.track is not None:
                self._commit_track(lv)
            if step.request_id in result.sampled:
                req.output_ids.append(int(result.sampled[step.request_id]))
                if len(req.output_ids) >= lv.request.max_new_tokens:
                    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            if req.finished():
                release_kv_cache(req, self.cache, checkpoint=True)
                self._forget(step.request_id)
                finished.append(step.request_id)
            elif not lv.decode:
                # A prefill chunk (the last one too, whose token was sampled) is published
                # into the tree, as SGLang's result processor does (stash_chunked_request /
                # checkpoint_kv_cache).  In no_buffer mode that forks the running state into
                # a new slot with a pool copy, which must reach the harness's memory before
                # the running slot is extended again: the checkpoint runs at the start of the
                # next plan, whose copies the harness executes before computing.
                if self.opts.extra_buffer:
                    checkpoint_kv_cache(req, self.cache)
                else:
                    lv.pending_checkpoint = True
        return finished

    def abort(self, request_id: str) -> None:
        lv = self.live.get(request_id)
        if lv is None:
            return
        if lv.admitted:
            # SGLang finishes an aborted running request with FINISH_ABORT and releases it
            # through the same path as a finished one (its computed prefix is kept).
            lv.pending_checkpoint = False  # superseded by the final checkpoint below
            lv.req.finished_reason = FINISH_ABORT()
            release_kv_cache(lv.req, self.cache, checkpoint=True)
        self._forget(request_id)

    def view(self):
        running = tuple(rid for rid in self.order if self.live[rid].admitted)
        return build_view(self, running)

    # -- scheduler duties ------------------------------------------------------------
    def _flush_checkpoint(self, lv: _Live) -> None:
        if lv.pending_checkpoint:
            lv.pending_checkpoint = False
            checkpoint_kv_cache(lv.req, self.cache)
            self.stats["forks"] += 1

    def _continue(self, lv: _Live, budget: int) -> RequestStep | None:
        req = lv.req
        if lv.pending_checkpoint and self.allocator.available_size() + self.cache.full_evictable_size() < 2 * self.P:
            # No room for this request's next step: keep its checkpoint (and the fork copy it
            # makes) for the step that will run, so no copy waits in an empty plan.
            return None
        self._flush_checkpoint(lv)
        total = len(req.origin_input_ids) + len(req.output_ids)
        done = req.kv.kv_committed_len
        if done >= len(req.origin_input_ids):
            return self._decode(lv, done)
        # next prefill chunk: prefix_len was moved to the chunk end by checkpoint_kv_cache
        return self._extend(lv, budget, total)

    def _admit(self, lv: _Live, budget: int) -> RequestStep | None:
        req = lv.req
        req.kv.mamba_cow_src_index = None  # a match that finds no state must not see an old source
        req.init_next_round_input(self.cache)  # SGLang's match: match_prefix(cow_mamba=True)
        self.stats["lookups"] += 1
        cow = req.kv.mamba_cow_src_index
        lv.init = copy_from(int(cow)) if cow is not None and req.prefix_len > 0 else FRESH
        req.lock = self.cache.lock(req.last_node)  # PrefillAdder._commit_prefill_admission
        step = self._extend(lv, budget, len(req.origin_input_ids), first=True)
        if step is None:
            # Not admitted this step: undo the lock and the copy-on-write slot the match took.
            self.cache.unlock(req.lock)
            req.lock = None
            if req.kv.holds_mamba:
                self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            req.kv.mamba_cow_src_index = None
            return None
        lv.admitted = True
        self.stats["hit_tokens"] += req.prefix_len
        return step

    def _extend(self, lv: _Live, budget: int, total: int, first: bool = False) -> RequestStep | None:
        req, P = lv.req, self.P
        start = req.prefix_len
        n = min(total - start, budget)
        if start + n < total:
            n = n // P * P  # a chunk that is not the last ends on a page (PrefillAdder's truncation)
        if n <= 0:
            return None
        need_kv = n + P
        if self.allocator.available_size() + self.cache.full_evictable_size() < need_kv:
            return None
        if first and (self.req_pool.available_size() < 1
                      or not ensure_mamba_capacity(self.req_pool, [req], self.cache)):
            return None  # no req_to_token row or Mamba slot for it: it waits (the scheduler's budget)
        req.extend_end = start + n
        batch = _Batch(reqs=[req], device="cpu", prefix_lens=[start], extend_lens=[n], extend_num_tokens=n,
                       seq_lens=torch.tensor([start + n]), seq_lens_cpu=torch.tensor([start + n]),
                       req_to_token_pool=self.req_pool, tree_cache=self.cache, hisparse_coordinator=None,
                       model_config=self._fake_model)
        try:
            alloc_for_extend(batch)
        except RuntimeError:
            return None  # out of memory after eviction: the request waits
        lv.decode = False
        snapshots: tuple[tuple[int, int], ...] = ()
        lv.track = None
        if self.opts.extra_buffer:
            entry = self.prepare_track(batch, req)
            if entry.track_mask:
                pos = req.kv.mamba_last_track_seqlen
                slot = self._track_slot(req, entry.track_position)
                snapshots = ((pos, slot),)
                lv.track = (pos, entry.track_position, "extend")
                self.stats["tracks"] += 1
        init, lv.init = (lv.init if first else RESUME), RESUME
        return RequestStep(req.rid, start, start + n, self._table(req, start + n), int(req.kv.mamba_pool_idx),
                           init, snapshots)

    def _decode(self, lv: _Live, length: int) -> RequestStep | None:
        req = lv.req
        if self.allocator.available_size() + self.cache.full_evictable_size() < self.P:
            return None
        batch = _Batch(reqs=[req], device="cpu", seq_lens=torch.tensor([length]), seq_lens_cpu=torch.tensor([length]),
                       req_pool_indices=torch.tensor([req.kv.req_pool_idx]),
                       req_pool_indices_cpu=torch.tensor([req.kv.req_pool_idx]),
                       req_to_token_pool=self.req_pool, tree_cache=self.cache, hisparse_coordinator=None,
                       model_config=self._fake_model)
        try:
            alloc_for_decode(batch, token_per_req=1)
        except RuntimeError:
            return None
        req.decode_batch_idx += 1
        lv.decode = True
        lv.track = None
        snapshots: tuple[tuple[int, int], ...] = ()
        if self.opts.extra_buffer and (length + 1) % mamba_track_grid(self.P) == 0:
            # prepare_for_decode's track mask: the forward writes the state after
            # length+1 tokens into the ping-pong slot named by mamba_next_track_idx.
            idx = req.kv.mamba_next_track_idx
            slot = self._track_slot(req, idx)
            snapshots = ((length + 1, slot),)
            lv.track = (length + 1, idx, "decode")
            self.stats["tracks"] += 1
        return RequestStep(req.rid, length, length + 1, self._table(req, length + 1), int(req.kv.mamba_pool_idx),
                           RESUME, snapshots)

    def _commit_track(self, lv: _Live) -> None:
        """What SGLang's result processor records after a decode step that
        crossed a track boundary (the extend case was recorded at prepare time)."""
        assert lv.track is not None  # called for a step that tracked
        pos, idx, kind = lv.track
        lv.track = None
        if kind != "decode":
            return
        kv = lv.req.kv
        kv.mamba_last_track_idx = idx
        kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
        kv.mamba_last_track_seqlen = pos
        kv.mamba_next_track_idx = self.req_pool.get_mamba_ping_pong_other_idx(idx)

    def _track_slot(self, req: Req, idx: int) -> int:
        """The slot the forward's track-save writes: the kernels read the pool's
        device-side row table (``req_index_to_mamba_ping_pong_track_buffer_mapping``),
        which SGLang keeps in sync with ``req.kv.mamba_ping_pong_track_buffer``."""
        row = self.req_pool.req_index_to_mamba_ping_pong_track_buffer_mapping[req.kv.req_pool_idx]
        return int(row[idx])

    def _table(self, req: Req, end: int) -> tuple[int, ...]:
        row = self.req_pool.req_to_token[req.kv.req_pool_idx, :end:self.P]
        return tuple(int(x) // self.P for x in row.tolist())

    def _forget(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.order.remove(rid)
