"""The reference disaggregated implementation: prefill on one worker, a
transfer, decode on the other, under heterogeneous layouts.

What it does right (each a place a mutant breaks, see
``fault_injection/disagg_mutants.py``):

- logical-to-physical mapping across block sizes: token ranges are cut at
  both workers' block boundaries, so a 32-token decode block is filled from
  two 16-token prefill blocks and a 32-token prefill block feeds two decode
  blocks; exactly the computed tokens move, never a block's stale rest;
- per-shard state: for every recurrent layer, every conv part (q, k, v) and
  the matrix state, head by head from the source shard to the destination
  shard, at offsets computed from each side's own geometry;
- tail zeroing: every KV page handed to a request on the decode side is
  zeroed first, so the tile the decode kernel reads past the last token
  holds zeros, never a previous request's bytes;
- completion verification: the decode side decodes only after a notice with
  every chunk completed and every chunk's source and destination digests
  equal; a failed, short, corrupt or never-notified transfer (deadline) means
  recomputing the prompt on the decode side;
- a metadata check: a peer whose state dtype or shape differs is refused,
  every prompt is then recomputed on the decode side;
- prefill stops at N-1 (as vLLM does for the recurrent layers): the decode
  side computes the last prompt token, whose logits give the first output;
- prefix caching on the prefill side: full blocks and block-boundary state
  snapshots, LRU-evicted when pages run out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from conformance.contract import FRESH, RESUME, ImplConfig, Request, RequestStep, copy_from
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

DEFAULTS = {"prefill_block": 16, "decode_block": 32, "prefill_shards": 2, "decode_shards": 1,
            "prefill_pages": 48, "decode_pages": 48, "op": "WRITE", "stop_at_n_minus_1": True,
            "deadline_steps": 6}


@dataclass
class DisaggRequest:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    phase: str = "prefill"  # prefill -> transfer -> wait -> decode -> done
    hit: int = 0
    p_blocks: list[int] = field(default_factory=list)  # prefill pages (KV blocks)
    p_owned: list[int] = field(default_factory=list)  # pages this request must free itself
    p_cached: list[tuple] = field(default_factory=list)  # cache keys it holds a reference on
    p_slot: int | None = None
    d_blocks: list[int] = field(default_factory=list)
    d_slot: int | None = None
    computed: int = 0  # decode-side tokens whose KV/state are in decode memory
    transfer_id: int | None = None
    waited: int = 0
    recompute: bool = False
    generated: int = 0


class Pool:
    def __init__(self, n: int):
        self.free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, page: int) -> None:
        self.free.append(page)


class ReferenceDisagg:
    name, version = "reference-disagg", "0.1"

    def __init__(self, config: ImplConfig | None = None):
        opts = dict(DEFAULTS, **((config.options if config else {}) or {}))
        self.opts = opts
        self.layouts = DisaggLayouts(
            WorkerLayout(PREFILL, opts["prefill_block"], opts["prefill_pages"], opts["prefill_shards"]),
            WorkerLayout(DECODE, opts["decode_block"], opts["decode_pages"], opts["decode_shards"]))
        self.P: WorkerGeometry  # set by connect(): what the metadata exchange said
        self.D: WorkerGeometry
        self.refused = ""
        self.ppool = Pool(opts["prefill_pages"])
        self.dpool = Pool(opts["decode_pages"])
        # prefill prefix cache: key (token prefix) -> [page, refcount]; LRU order
        self.cache: OrderedDict[tuple, list] = OrderedDict()
        self.reqs: dict[str, DisaggRequest] = {}
        self.next_transfer = 1
        self.transfers: dict[int, str] = {}  # transfer id -> request id
        self._orphans: dict[int, DisaggRequest] = {}  # aborted while their transfer was in flight

    # -- contract ------------------------------------------------------------------------
    def disagg_layouts(self) -> DisaggLayouts:
        return self.layouts

    def layout(self):  # the single-worker contract's method, for tools that ask
        from conformance.contract import Layout
        return Layout(self.layouts.decode.block_size, self.layouts.decode.num_pages, self.layouts.decode.num_pages)

    def connect(self, hs: Handshake) -> None:
        self.P, self.D = hs.prefill, hs.decode
        self.refused = self._compatible(hs.prefill, hs.decode)

    @staticmethod
    def _compatible(p: WorkerGeometry, d: WorkerGeometry) -> str:
        if p.layout.state_dtype != d.layout.state_dtype:
            return f"state dtype differs: prefill {p.layout.state_dtype}, decode {d.layout.state_dtype}"
        shape = ("attn_layers", "attn_heads", "head_dim", "rec_layers", "rec_heads", "key_dim", "value_dim",
                 "conv_rows")
        diff = [s for s in shape if getattr(p, s) != getattr(d, s)]
        return f"model shapes differ: {', '.join(diff)}" if diff else ""

    def add_request(self, r: Request) -> None:
        if r.request_id in self.reqs:
            raise ValueError(f"request {r.request_id} already running")
        self.reqs[r.request_id] = DisaggRequest(r.request_id, list(r.prompt), len(r.prompt), r.max_new_tokens)

    def abort(self, rid: str) -> None:
        r = self.reqs.pop(rid, None)
        if r is None:
            return
        if r.transfer_id is not None and r.phase == "wait":
            # bytes may still land in its decode pages: keep them until the transfer's
            # notice, or its deadline (a lost notification), has passed
            r.waited = 0
            self._orphans[r.transfer_id] = r
            self._release_prefill(r)
            return
        self._release_prefill(r)
        self._release_decode(r)

    def view(self) -> dict:
        """Pages each worker's requests and cache hold (the harness checks them against memory)."""
        held_p = {p for r in self.reqs.values() for p in r.p_owned + ([r.p_slot] if r.p_slot is not None else [])}
        held_p |= {e[0] for e in self.cache.values()}
        held_d = {p for r in list(self.reqs.values()) + list(self._orphans.values())
                  for p in r.d_blocks + ([r.d_slot] if r.d_slot is not None else [])}
        return {"prefill_used": sorted(held_p), "decode_used": sorted(held_d),
                "prefill_free": len(self.ppool.free), "decode_free": len(self.dpool.free),
                "running": tuple(self.reqs)}

    # -- schedule --------------------------------------------------------------------------
    def schedule(self, budget: int = 1 << 30) -> DisaggPlan:
        steps: list[RequestStep] = []
        transfers: list[DisaggTransfer] = []
        zero: list[ZeroRegion] = []
        for tid, orphan in list(self._orphans.items()):
            orphan.waited += 1
            if orphan.waited > self.opts["deadline_steps"]:
                del self._orphans[tid]
                self._release_decode(orphan)
        for r in list(self.reqs.values()):
            if r.phase == "prefill":
                self._plan_prefill(r, steps, zero)
            elif r.phase == "transfer":
                self._plan_transfer(r, transfers, zero)
            elif r.phase == "wait":
                r.waited += 1
                if r.waited > self.opts["deadline_steps"]:
                    self._give_up(r, "no notice before the deadline")
            if r.phase == "decode":
                self._plan_decode(r, steps, zero)
        return DisaggPlan(tuple(steps), tuple(transfers), tuple(zero))

    def _target(self, r: DisaggRequest) -> int:
        """Tokens the prefill side computes and transfers."""
        return r.prompt_len - 1 if self.opts["stop_at_n_minus_1"] else r.prompt_len

    # prefill ------------------------------------------------------------------------------
    def _take_p(self) -> int:
        """A prefill page (evicting unreferenced cache entries); callers checked there is one."""
        page = self.ppool.take()
        while page is None and self._evict_one():
            page = self.ppool.take()
        if page is None:
            raise RuntimeError("prefill pages exhausted after the availability check")
        return page

    def _try_take_p(self) -> int | None:
        try:
            return self._take_p()
        except RuntimeError:
            return None

    def _evict_one(self) -> bool:
        for key, (page, ref) in self.cache.items():
            if ref == 0:
                del self.cache[key]
                self.ppool.give(page)
                return True
        return False

    def _plan_prefill(self, r: DisaggRequest, steps, zero) -> None:
        T = self._target(r)
        if T <= 0 or self.refused:
            r.recompute = True
            r.phase = "decode"
            return
        Bp = self.P.block_size
        prompt = tuple(r.tokens[: r.prompt_len])
        # longest cached prefix: full blocks plus a state snapshot at their end, leaving >= 1 token
        hit = 0
        j = 1
        while j * Bp < T and ("kv", prompt[: j * Bp]) in self.cache:
            if ("state", prompt[: j * Bp]) in self.cache:
                hit = j * Bp
            j += 1
        need_blocks = -(-T // Bp) - hit // Bp
        need = need_blocks + 1 + max(0, T // Bp - hit // Bp)  # blocks, running slot, snapshots
        if len(self.ppool.free) + sum(1 for e in self.cache.values() if e[1] == 0) < need + 2:
            return  # wait for pages
        for j in range(hit // Bp):
            key = ("kv", prompt[: (j + 1) * Bp])
            self._ref(key)
            r.p_cached.append(key)
            r.p_blocks.append(self.cache[key][0])
        init = FRESH
        if hit:
            self._ref(("state", prompt[:hit]))
            r.p_cached.append(("state", prompt[:hit]))
            init = copy_from(self.cache[("state", prompt[:hit])][0])
        for _ in range(need_blocks):
            page = self._take_p()
            r.p_blocks.append(page)
            r.p_owned.append(page)
        r.p_slot = self._take_p()
        snaps = []
        for b in range(hit // Bp + 1, T // Bp + 1):
            key = ("state", prompt[: b * Bp])
            if key in self.cache or b * Bp == hit:
                continue
            snap_page = self._try_take_p()
            if snap_page is None:
                break
            self.cache[key] = [snap_page, 1]  # held until the step that writes it has run
            r.p_cached.append(key)
            snaps.append((b * Bp, snap_page))
        r.hit = hit
        assert r.p_slot is not None
        steps.append(RequestStep(r.rid, hit, T, tuple(r.p_blocks), r.p_slot, init, tuple(snaps), worker=PREFILL))
        r.phase = "prefilling"

    def _ref(self, key) -> None:
        self.cache[key][1] += 1
        self.cache.move_to_end(key)

    def _publish_prefill(self, r: DisaggRequest) -> None:
        """After the prefill step: its full blocks become cached (shared) entries."""
        Bp = self.P.block_size
        T = self._target(r)
        prompt = tuple(r.tokens[: r.prompt_len])
        for j in range(r.hit // Bp, T // Bp):
            key = ("kv", prompt[: (j + 1) * Bp])
            page = r.p_blocks[j]
            if key in self.cache:
                continue
            self.cache[key] = [page, 1]
            r.p_owned.remove(page)
            r.p_cached.append(key)

    def _release_prefill(self, r: DisaggRequest) -> None:
        for key in r.p_cached:
            if key in self.cache:
                self.cache[key][1] -= 1
        for page in r.p_owned + ([r.p_slot] if r.p_slot is not None else []):
            self.ppool.give(page)
        r.p_cached, r.p_owned, r.p_blocks, r.p_slot = [], [], [], None

    # transfer -----------------------------------------------------------------------------
    def _take_d(self, zero) -> int:
        page = self.dpool.take()
        if page is None:
            raise RuntimeError("decode pages exhausted after the availability check")
        zero.extend(self._zero_new_page(page))
        return page

    def _zero_new_page(self, page: int) -> list[ZeroRegion]:
        """Zero the KV view of a page handed to a request: the decode kernel's
        tile reads past the last token, and stale bytes there must be zeros."""
        return [ZeroRegion(DECODE, self.D.page_offset(page), self.D.kv_view_bytes)]

    def _decode_pages(self, r: DisaggRequest, upto: int, zero) -> bool:
        Bd = self.D.block_size
        need = -(-upto // Bd) - len(r.d_blocks) + (1 if r.d_slot is None else 0)
        if need > len(self.dpool.free):
            return False
        while len(r.d_blocks) * Bd < upto:
            r.d_blocks.append(self._take_d(zero))
        if r.d_slot is None:
            r.d_slot = self.dpool.take()
        return r.d_slot is not None

    def _plan_transfer(self, r: DisaggRequest, transfers, zero) -> None:
        T = self._target(r)
        if not self._decode_pages(r, r.prompt_len, zero):
            return
        assert r.p_slot is not None and r.d_slot is not None
        kv = self.kv_descriptors(r, T)
        state = self.state_descriptors(r.p_slot, r.d_slot)
        tid = self.next_transfer
        self.next_transfer += 1
        transfers.append(DisaggTransfer(tid, r.rid, tuple(c for c in (kv, state) if c), self.opts["op"]))
        self.transfers[tid] = r.rid
        r.transfer_id = tid
        r.phase = "wait"
        r.waited = 0

    def kv_descriptors(self, r: DisaggRequest, T: int) -> tuple[Descriptor, ...]:
        """Token ranges cut at both sides' block boundaries, per attention layer and K/V."""
        P, D = self.P, self.D
        out = []
        pos = 0
        while pos < T:
            pi, po = divmod(pos, P.block_size)
            di, do = divmod(pos, D.block_size)
            n = min(T - pos, P.block_size - po, D.block_size - do)
            for layer in range(P.attn_layers):
                for kv in (0, 1):
                    out.append(Descriptor(P.kv_offset(r.p_blocks[pi], layer, kv, po),
                                          self.dst_kv_offset(r.d_blocks[di], layer, kv, do), n * P.kv_row_bytes))
            pos += n
        return _merge(out)

    def dst_kv_offset(self, page: int, layer: int, kv: int, pos: int) -> int:
        return self.D.kv_offset(page, layer, kv, pos)

    def state_descriptors(self, src_slot: int, dst_slot: int) -> tuple[Descriptor, ...]:
        """Head by head, part by part: source shard -> destination shard."""
        P = self.P
        out = []
        for layer in range(P.rec_layers):
            for h in range(P.rec_heads):
                for part in self.state_parts():
                    out.append(self.state_descriptor(src_slot, dst_slot, layer, h, part))
        return _merge(out)

    def state_parts(self) -> tuple[str, ...]:
        return PARTS + ("ssm",)

    def state_descriptor(self, src_slot: int, dst_slot: int, layer: int, head: int, part: str) -> Descriptor:
        P, D = self.P, self.D
        ps, pl = P.shard_of(head)
        ds, dl = D.shard_of(head)
        if part == "ssm":
            return Descriptor(P.ssm_offset(src_slot, ps, layer, pl), D.ssm_offset(dst_slot, ds, layer, dl),
                              P.ssm_head_bytes)
        n = P.part_dim(part) * P.conv_rows * P.state_item
        return Descriptor(P.conv_part_offset(src_slot, ps, layer, part, pl),
                          D.conv_part_offset(dst_slot, ds, layer, part, dl), n)

    def _give_up(self, r: DisaggRequest, why: str) -> None:
        """The transfer cannot be trusted: recompute the prompt on the decode side."""
        if r.transfer_id is not None:
            self.transfers.pop(r.transfer_id, None)
        r.transfer_id = None
        r.recompute = True
        r.phase = "decode"
        r.computed = 0
        self._release_prefill(r)

    # decode -------------------------------------------------------------------------------
    def _plan_decode(self, r: DisaggRequest, steps, zero) -> None:
        start = 0 if r.recompute else max(r.computed, self._target(r))
        if r.recompute and r.computed:
            start = r.computed
        end = len(r.tokens)
        if start >= end:
            return
        if not self._decode_pages(r, end, zero):
            return
        init = FRESH if start == 0 else RESUME
        assert r.d_slot is not None
        steps.append(RequestStep(r.rid, start, end, tuple(r.d_blocks), r.d_slot, init, worker=DECODE))

    # -- update ---------------------------------------------------------------------------
    def update(self, plan: DisaggPlan, result: DisaggResult) -> list[str]:
        for notice in result.notices:
            self.on_notice(notice)
        finished = []
        for s in plan.requests:
            r = self.reqs.get(s.request_id)
            if r is None:
                continue
            if s.worker == PREFILL:
                self._publish_prefill(r)
                r.phase = "transfer"
                continue
            r.computed = s.end
            if s.request_id in result.sampled:
                r.tokens.append(result.sampled[s.request_id])
                r.generated += 1
                if r.generated >= r.max_new:
                    finished.append(s.request_id)
        for rid in finished:
            r = self.reqs.pop(rid)
            self._release_prefill(r)
            self._release_decode(r)
        return finished

    def on_notice(self, n: TransferNotice) -> None:
        orphan = self._orphans.pop(n.id, None)
        if orphan is not None:
            self._release_decode(orphan)
            return
        rid = self.transfers.pop(n.id, None)
        r = self.reqs.get(rid) if rid else None
        if r is None or r.transfer_id != n.id:
            return  # late notice of a transfer already given up on
        if self.received(n):
            r.phase = "decode"
            r.transfer_id = None
            self._release_prefill(r)
        else:
            self._give_up(r, n.error or "digest mismatch")

    @staticmethod
    def received(n: TransferNotice) -> bool:
        return n.ok and bool(n.chunks) and all(c.ok and c.src_digest == c.dst_digest for c in n.chunks)

    def _release_decode(self, r: DisaggRequest) -> None:
        for page in r.d_blocks + ([r.d_slot] if r.d_slot is not None else []):
            self.dpool.give(page)
        r.d_blocks, r.d_slot = [], None


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
