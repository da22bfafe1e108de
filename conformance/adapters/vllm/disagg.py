"""VllmDisagg: the disaggregated contract (``conformance.disagg.contract``) on
top of two real vLLM ``Scheduler``s (0.30.0-0.33.0), each with the NixlConnector's
scheduler side (``kv_producer`` for prefill, ``kv_consumer`` for decode,
``kv_load_failure_policy="recompute"``).  ``--impl vllm --check disagg-transfer``
reaches it through ``VllmCache.disagg_factory``.

Every decision is vLLM's: the prefill's truncation to N-1 and its one-token
cap (``_truncate_request_for_prefill``), the held blocks and the transfer
parameters (``request_finished``), the decode side's claim
(``get_num_new_matched_tokens``), its local hit, the blocks it allocates and
names in ``NixlConnectorMetadata.reqs_to_recv``, its waiting in
``WAITING_FOR_REMOTE_KVS``, its recovery from ``failed_recving``.  The harness
stands where vLLM's *workers* would, and this module translates what vLLM told
them into the harness's terms:

- each side's ``SchedulerOutput`` -> worker-tagged ``RequestStep``s, by the
  same ``preprocess_mamba`` derivation the single-scheduler adapter uses
  (:class:`.translate.RunnerState`, one per side);
- each ``reqs_to_recv`` entry -> one READ ``DisaggTransfer`` (vLLM's NIXL
  worker pulls): the attention blocks' K/V for the tokens the decode side
  claimed (``[local hit, remote_num_tokens)``), cut at both sides' block
  boundaries, into the blocks vLLM allocated (checked to be among
  ``local_block_ids[0]``), and the one Mamba slot vLLM sends
  (``remote_block_ids[1]``) into the one it names (``local_block_ids[1]``),
  head by head and conv part by part from the prefill's shards to the
  decode's (the stand-in for tensor parallelism);
- each notice -> ``finished_recving`` (and ``failed_recving`` when the notice
  failed or a chunk's digests differ: NIXL reports a failed handle, and a
  partial arrival must never read as done) for the decode scheduler, and
  ``finished_sending`` for the prefill scheduler (the read-done notification
  that frees its held blocks).  A request whose transfer never reports within
  ``deadline_steps`` is reported failed (NIXL has no timeout; vLLM's worker
  gives up on a handle in the same way only through its own abort timeout);
- a ``reqs_to_recv`` entry with nothing to pull (full local hit, or aborted
  before it was scheduled) -> ``finished_sending`` on the prefill side, as the
  worker's notification does.

Worker duties this module performs (and so tests the harness's code, not
vLLM's): the pairing of token ranges, the digest check, the tail of the last
KV block a decode step reads past its last token is zeroed (vLLM's attention
kernels mask those loads; the harness's tile kernel reads them, so the
runner's equivalent is a zeroed tail).  The prefill's one sampled token is
never judged: the adapter hands vLLM's prefill a placeholder, the session
samples only decode steps.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request as VRequest
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from conformance.adapters.vllm.config import ATTN_GROUP, MAMBA_GROUP, VllmOptions
from conformance.adapters.vllm.startup import start
from conformance.adapters.vllm.translate import RunnerState
from conformance.contract import ImplConfig, Layout, Request
from conformance.disagg.contract import (
    DECODE,
    PREFILL,
    Descriptor,
    DisaggLayouts,
    DisaggPlan,
    DisaggResult,
    DisaggTransfer,
    Handshake,
    TransferNotice,
    WorkerLayout,
    ZeroRegion,
)
from conformance.disagg.geometry import PARTS, WorkerGeometry

# What vLLM's toy proxy sends to the prefill instance.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_EOS = 2
_PLACEHOLDER = 0  # the prefill's one sampled token: vLLM needs one, nobody reads it
DEFAULTS = {"prefill_block": 16, "decode_block": 16, "prefill_shards": 1, "decode_shards": 1,
            "prefill_pages": 64, "decode_pages": 64, "deadline_steps": 16, "op": "READ"}
KNOWN = set(DEFAULTS)


def nixl_transfer_config(role: Literal["kv_producer", "kv_consumer"]) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=str(uuid.uuid4()),
                            kv_buffer_device="cpu", kv_load_failure_policy="recompute")


@dataclass
class _Side:
    worker: str
    opts: VllmOptions
    scheduler: Scheduler
    runner: RunnerState
    hasher: Any
    config: dict  # what it was started with (.startup)
    pending_so: Any = None
    out: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def used(self) -> list[int]:
        return sorted(b.block_id for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null)


@dataclass
class _Recv:
    rid: str
    transfer_id: int
    waited: int = 0


class VllmDisagg:
    name = "vllm-disagg"

    def __init__(self, config: ImplConfig | None = None):
        import conformance.adapters.vllm.compat as compat

        self.version, self.build = compat.installed().version, compat.installed().build
        o = dict(DEFAULTS, **((config.options if config else {}) or {}))
        unknown = set(o) - KNOWN
        if unknown:
            raise ValueError(f"unknown vLLM disaggregated options: {sorted(unknown)} (known: {sorted(KNOWN)})")
        if o["op"] != "READ":
            # vLLM's NixlConnector pulls (the decode side READs); a WRITE pairing is run as READ.
            o["op"] = "READ"
        self.o = o
        init_none_hash(sha256)
        self.prefill = self._side(PREFILL, o["prefill_block"], o["prefill_pages"], "kv_producer")
        self.decode = self._side(DECODE, o["decode_block"], o["decode_pages"], "kv_consumer")
        self.layouts = DisaggLayouts(
            WorkerLayout(PREFILL, o["prefill_block"], o["prefill_pages"], o["prefill_shards"]),
            WorkerLayout(DECODE, o["decode_block"], o["decode_pages"], o["decode_shards"]))
        self.P: WorkerGeometry
        self.D: WorkerGeometry
        self.refused = ""
        self.prompts: dict[str, Request] = {}
        self.live: set[str] = set()  # added, neither finished nor aborted
        self.aborted: set[str] = set()
        self.recv: dict[int, _Recv] = {}  # transfer id -> the decode request it feeds
        self.next_transfer = 1
        self.stats = {"transfers": 0, "failed_recving": 0, "finished_sending": 0, "local_only": 0,
                      "expired": 0}
        self._done: set[str] = set()  # decode requests vLLM finished during this update

    def _side(self, worker: str, block: int, pages: int, role: Literal["kv_producer", "kv_consumer"]) -> _Side:
        # As the engine core starts each instance (.startup): max_model_len fitted to its pool.
        startup = start(VllmOptions(block_size=block, num_blocks=pages, prefix_match_unit=block),
                        nixl_transfer_config(role))
        opts, vc, kvc = startup.opts, startup.vllm_config, startup.kv_cache_config
        s = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=block, hash_block_size=block, log_stats=True)
        # MambaMixer2's spec: the runner exports prefill checkpoints in lockstep with the scheduler.
        return _Side(worker, opts, s, RunnerState.for_config(vc, kvc), get_request_block_hasher(block, sha256),
                     startup.describe())

    def engine_config(self) -> dict:
        """The configuration each instance was started with (recorded with the check's result)."""
        return {PREFILL: self.prefill.config, DECODE: self.decode.config}

    # -- contract ------------------------------------------------------------------------
    def disagg_layouts(self) -> DisaggLayouts:
        return self.layouts

    def layout(self) -> Layout:
        d = self.layouts.decode
        return Layout(d.block_size, d.num_pages, d.num_pages)

    def connect(self, hs: Handshake) -> None:
        self.P, self.D = hs.prefill, hs.decode
        # vLLM's worker compares a compatibility hash (model, dtypes, layouts) at the NIXL
        # handshake and raises on a mismatch (``enforce_handshake_compat``, nixl/base_worker.py);
        # the load then fails and the request is reported in failed_recving.
        p, d = hs.prefill, hs.decode
        shape = ("attn_layers", "attn_heads", "head_dim", "rec_layers", "rec_heads", "key_dim", "value_dim",
                 "conv_rows")
        diff = [f for f in shape if getattr(p, f) != getattr(d, f)]
        if p.layout.state_dtype != d.layout.state_dtype:
            diff.append(f"state dtype {p.layout.state_dtype} vs {d.layout.state_dtype}")
        self.refused = f"NIXL compatibility hash mismatch: {', '.join(diff)}" if diff else ""

    def add_request(self, r: Request) -> None:
        if r.request_id in self.prompts:
            raise ValueError(f"request {r.request_id} already added")
        self.prompts[r.request_id] = r
        self.live.add(r.request_id)
        self.prefill.scheduler.add_request(self._vreq(self.prefill, r.request_id, list(r.prompt), 1,
                                                      dict(PREFILL_PARAMS)))

    def abort(self, rid: str) -> None:
        if rid not in self.live:
            return
        self.live.discard(rid)
        self.aborted.add(rid)
        for side in (self.prefill, self.decode):
            if rid in side.scheduler.requests and not side.scheduler.requests[rid].is_finished():
                side.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def view(self) -> dict:
        return {"prefill_used": self.prefill.used(), "decode_used": self.decode.used(),
                "prefill_free": self.prefill.pool.get_num_free_blocks(),
                "decode_free": self.decode.pool.get_num_free_blocks(), "running": tuple(sorted(self.live))}

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self, budget: int = 1 << 30) -> DisaggPlan:
        if self.prefill.pending_so is not None:
            raise RuntimeError("schedule() called twice without update()")
        steps, zero, transfers = [], [], []
        for side in (self.prefill, self.decode):
            so = side.scheduler.schedule()
            side.pending_so = so
            plan = side.runner.to_plan(so)
            if plan.kv_copies:
                raise NotImplementedError(f"{side.worker}: vLLM asked for block copies {plan.kv_copies}; "
                                          "the disaggregated contract has no copies yet")
            for rs in plan.requests:
                rs = replace(rs, worker=side.worker)
                steps.append(rs)
                if side is self.decode:
                    zero.extend(self._zero_tail(rs.block_table, rs.end))
            meta = so.kv_connector_metadata
            if side is self.decode and meta is not None:
                transfers.extend(self._receives(meta))
        self._expire()
        return DisaggPlan(tuple(steps), tuple(transfers), tuple(zero))

    def _zero_tail(self, table: tuple[int, ...], end: int) -> list[ZeroRegion]:
        D = self.D
        first = end % D.block_size
        if not first:
            return []
        page = table[end // D.block_size]
        n = (D.block_size - first) * D.kv_row_bytes
        return [ZeroRegion(DECODE, D.kv_offset(page, layer, kv, first), n)
                for layer in range(D.attn_layers) for kv in (0, 1)]

    def _receives(self, meta) -> list[DisaggTransfer]:
        out = []
        for rid, m in (getattr(meta, "reqs_to_recv", None) or {}).items():
            local = m.local_block_ids
            if not getattr(m, "awaiting_kvs", True) or not local or not any(local):
                # nothing to pull: the worker only notifies the prefill side
                self.stats["local_only"] += 1
                self._send_done(rid)
                continue
            if self.refused:
                self._recv_done(rid, ok=False)  # the handshake failed: nothing is read
                continue
            out.append(self._transfer(rid, m))
        return out

    def _transfer(self, rid: str, m) -> DisaggTransfer:
        local, remote = m.local_block_ids, m.remote.block_ids
        # The tokens the decode side claimed (vLLM's worker reads no more than the blocks it
        # allocated for them), never more than the prefill computed (N-1 for Mamba).
        claimed = self.decode.scheduler.requests[rid].num_computed_tokens
        T = min(int(m.remote.num_tokens or claimed), claimed)
        # The decode side's local hit, in its attention group (vLLM never re-sends it).
        hit = m.local_num_computed_blocks
        L = (hit[ATTN_GROUP] if hit else 0) * self.D.block_size
        table = self.decode.scheduler.kv_cache_manager.get_block_ids(rid)[ATTN_GROUP]
        P, D = self.P, self.D
        named = set(local[ATTN_GROUP])
        kv = []
        pos = L
        while pos < T:
            pi, po = divmod(pos, P.block_size)
            di, do = divmod(pos, D.block_size)
            n = min(T - pos, P.block_size - po, D.block_size - do)
            dst = table[di]
            if dst not in named:
                raise RuntimeError(f"{rid}: token {pos} lands in decode block {dst}, which vLLM did not name in "
                                   f"local_block_ids {local[ATTN_GROUP]}")
            for layer in range(P.attn_layers):
                for k in (0, 1):
                    kv.append(Descriptor(P.kv_offset(remote[ATTN_GROUP][pi], layer, k, po),
                                         D.kv_offset(dst, layer, k, do), n * P.kv_row_bytes))
            pos += n
        state = self._state(remote[MAMBA_GROUP][-1], local[MAMBA_GROUP][-1])
        tid = self.next_transfer
        self.next_transfer += 1
        self.recv[tid] = _Recv(rid, tid)
        self.stats["transfers"] += 1
        return DisaggTransfer(tid, rid, tuple(c for c in (_merge(kv), state) if c), "READ")

    def _state(self, src: int, dst: int) -> tuple[Descriptor, ...]:
        P, D = self.P, self.D
        out = []
        for layer in range(P.rec_layers):
            for h in range(P.rec_heads):
                ps, pl = P.shard_of(h)
                ds, dl = D.shard_of(h)
                for part in PARTS:
                    out.append(Descriptor(P.conv_part_offset(src, ps, layer, part, pl),
                                          D.conv_part_offset(dst, ds, layer, part, dl),
                                          P.part_dim(part) * P.conv_rows * P.state_item))
                out.append(Descriptor(P.ssm_offset(src, ps, layer, pl), D.ssm_offset(dst, ds, layer, dl),
                                      P.ssm_head_bytes))
        return _merge(out)

    def _expire(self) -> None:
        """A transfer that never reports is a failed load (a guard: under READ every
        transfer reports, its own failure included)."""
        for tid, r in list(self.recv.items()):
            r.waited += 1
            if r.waited > self.o["deadline_steps"]:
                del self.recv[tid]
                self.stats["expired"] += 1
                self._recv_done(r.rid, ok=False)

    # -- update -------------------------------------------------------------------------------
    def update(self, plan: DisaggPlan, result: DisaggResult) -> list[str]:
        for n in result.notices:
            self.on_notice(n)
        for side in (self.prefill, self.decode):
            so, side.pending_so = side.pending_so, None
            ids = list(so.num_scheduled_tokens)
            reqs = side.scheduler.requests
            toks = []
            for rid in ids:
                # schedule() already advanced num_computed_tokens over the scheduled chunk
                done = reqs[rid].num_computed_tokens >= reqs[rid].num_tokens
                if side is self.prefill:
                    toks.append([_PLACEHOLDER] if done else [])
                else:
                    toks.append([result.sampled[rid]] if rid in result.sampled else [])
            kvo, side.out = side.out, KVConnectorOutput()
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=toks, kv_connector_output=kvo)
            for eco in side.scheduler.update_from_output(so, out).values():
                for o in eco.outputs:
                    if o.finished:
                        self._finished(side, o)
        finished = [rid for rid in list(self.live) if rid in self._done]
        for rid in finished:
            self.live.discard(rid)
        self._done.clear()
        return finished

    def _finished(self, side: _Side, o) -> None:
        rid = o.request_id
        if rid in self.aborted:
            return
        if side is self.decode:
            self._done.add(rid)
            return
        # the prefill finished: hand the request to the decode side with vLLM's parameters
        params = dict(o.kv_transfer_params or {})
        r = self.prompts[rid]
        params.update(do_remote_prefill=True, do_remote_decode=False)
        self.decode.scheduler.add_request(self._vreq(self.decode, rid, list(r.prompt), r.max_new_tokens, params))

    def on_notice(self, n: TransferNotice) -> None:
        r = self.recv.pop(n.id, None)
        if r is None:
            return  # already given up on
        ok = n.ok and bool(n.chunks) and all(c.ok and c.src_digest == c.dst_digest for c in n.chunks)
        self._recv_done(r.rid, ok)

    def _recv_done(self, rid: str, ok: bool) -> None:
        if rid in self.decode.scheduler.requests:
            out = self.decode.out
            self.decode.out = KVConnectorOutput(finished_recving=set(out.finished_recving or ()) | {rid},
                                                failed_recving=set(out.failed_recving or ()) | (set() if ok else {rid}))
            self.stats["failed_recving"] += int(not ok)
        self._send_done(rid)

    def _send_done(self, rid: str) -> None:
        """The decode worker's notification: the prefill side frees the held blocks."""
        if rid in self.prefill.scheduler.requests:
            out = self.prefill.out
            self.prefill.out = KVConnectorOutput(finished_sending=set(out.finished_sending or ()) | {rid},
                                                 failed_recving=out.failed_recving)
            self.stats["finished_sending"] += 1

    def _vreq(self, side: _Side, rid: str, prompt: list[int], max_tokens: int, params: dict) -> VRequest:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            extra_args={"kv_transfer_params": params})
        sp.update_from_generation_config({}, eos_token_id=_EOS)
        return VRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                        block_hasher=side.hasher)


def _merge(descs: list[Descriptor]) -> tuple[Descriptor, ...]:
    """Adjacent descriptors contiguous on both sides become one."""
    out: list[Descriptor] = []
    for d in descs:
        if out and out[-1].src_offset + out[-1].length == d.src_offset \
                and out[-1].dst_offset + out[-1].length == d.dst_offset:
            last = out.pop()
            d = Descriptor(last.src_offset, last.dst_offset, last.length + d.length)
        out.append(d)
    return tuple(out)
