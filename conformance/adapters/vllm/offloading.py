"""vLLM's own offloading connector as the second tier (``--option connector=offload-lru|offload-arc``).

vLLM 0.33's native CPU offloading is an ``OffloadingConnector`` (``SupportsHMA``)
over a pluggable ``OffloadingSpec`` (``kv_connector_extra_config``:
``spec_name``, ``spec_module_path``).  Here every decision is vLLM's:

- the **scheduler side** is vLLM's ``OffloadingConnector`` in the scheduler role,
  built by vLLM's ``Scheduler`` from the ``KVTransferConfig``
  (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``): which
  chunks are looked up (full attention left to right, the Mamba group as a
  window of one chunk, the hit window clamped to the Mamba block), which are
  stored (the attention chunks a step completed, the boundary states the core
  scheduler hands off, partial tails with sub-block matching, the retention
  interval's reachability masks), which stores must be flushed before a block
  is reused, and when a request waits for its loads;
- the **tier policy** is vLLM's ``CPUOffloadingManager`` (LRU or ARC), built by
  vLLM's own ``CPUOffloadingSpec.get_manager`` from ``cpu_bytes_to_use``:
  :class:`HarnessOffloadingSpec` subclasses ``CPUOffloadingSpec`` and replaces
  only ``get_worker``, whose stock implementation (``cpu/gpu_worker.py``) needs
  CUDA streams and events;
- the **worker side** is vLLM's ``OffloadingConnector`` in the worker role
  (``offloading/worker.py``: deferred stores, flushes, loads, completions), over
  :class:`HarnessOffloadingWorker`, which turns each job into the contract's
  :class:`~conformance.contract.Transfer` s (one per block, host key
  ``cpu<chunk>``: the manager's chunk index) and reports each job done when
  every one of its transfers completed.  The harness's transport moves the
  bytes, so held, late, out-of-order, failed, short and corrupted transfers
  (``tier-races``' decisions, ``--faults``) meet vLLM's tier.

Timing, as vLLM's model runner and the CPU worker's streams allow it: a store
job queued after step N (``wait_for_save``) is submitted at the start of step
N+1 (``handle_preemptions``) and copied asynchronously, so the harness reads
its source at the start of step N+2, after N+1's computation has written
whatever it writes (the latest an asynchronous copy that completes within a
step can read), unless vLLM waits for it (``jobs_to_flush``: a block of a
pending store is being reused): then it is read at the start of N+1, before
anything else.  Loads are issued with the step that schedules them and, being
asynchronous, the request waits in ``WAITING_FOR_REMOTE_KVS`` until the
worker reports them.

What vLLM 0.33 does not have, and the harness does not add: a failed job
(``worker.py`` ``get_finished``: "we currently do not support job failures",
``assert transfer_result.success``) and a check of the bytes that landed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

from conformance.adapters.vllm.config import Groups, attention_page_per_token
from conformance.contract import HostCached, Transfer, TransferDone

SPEC_NAME = "HarnessOffloadingSpec"
GROUP_KINDS = ("kv", "state")  # the adapter's groups (.config: ATTN_GROUP, MAMBA_GROUP), as harness memory holds them


def offloaded_groups(opts) -> int:
    """At least as many KV cache groups as vLLM makes of the model (each holds one layer or more): two
    without window layers (attention, Mamba), three with two Mamba layouts (``layer="mamba2+kda"``), at
    most one per layer with them (``opts.layer_kinds``: Gemma 3's five window layers are five groups)."""
    return max(len(GROUP_KINDS) + ("+" in opts.layer), len(opts.layer_kinds))

def host_chunks(num_blocks: int) -> int:
    """The CPU tier's capacity in chunks (one chunk = one block of one group here).

    Sixteen times the device pool: enough that vLLM's manager never has to
    evict within an example of the suite's tier checks (``stats["host_evictions"]``
    counts it if it does).  The expected-hit oracle reads the harness's host
    store, which learns that the manager evicted a chunk only when the store
    that reuses the chunk is copied, a step or two later; a request matched in
    between would be held to the evicted prefix (measured: at 2x the pool,
    tier-races[offload=lru] at seed 0 read 'device 0, host tier 28' for a
    prompt whose chunks LRU had just evicted)."""
    return 16 * num_blocks


def offloading_transfer_config(opts) -> KVTransferConfig:
    """The ``KVTransferConfig`` a deployment passes as ``--kv-transfer-config``,
    with this module's spec: ``cpu_bytes_to_use`` sized so that vLLM's own
    ``CPUOffloadingSpec`` arithmetic (one chunk holds one block of every
    offloaded group, rounded up to its alignment) gives :func:`host_chunks`
    chunks; one block per chunk, so the offload unit is the block."""
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    page = opts.block_size * attention_page_per_token()
    # every group's page (the Mamba page is padded to it; a group of several layers holds more, so a
    # model with window layers gets at least host_chunks chunks)
    chunk = -(-page * offloaded_groups(opts) // align) * align
    extra: dict[str, Any] = {"spec_name": SPEC_NAME, "spec_module_path": __name__,
                             "cpu_bytes_to_use": (opts.offload_chunks or host_chunks(opts.num_blocks)) * chunk,
                             "eviction_policy": opts.offload, "blocks_per_chunk": 1}
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                            kv_connector_extra_config=extra)


class HarnessOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` (its manager, capacity and policy), with the
    harness as the worker."""

    def get_worker(self, kv_caches) -> OffloadingWorker:
        return HarnessOffloadingWorker(self)


@dataclass
class _Job:
    request_id: str | None
    transfers: set[int]
    ok: bool = True


class HarnessOffloadingWorker(OffloadingWorker):
    """An ``OffloadingWorker`` whose copies are the harness's transfers."""

    def __init__(self, spec: CPUOffloadingSpec):
        self.spec = spec
        # per offloaded group, in GPULoadStoreSpec order: the harness memory it lands in (the kind, and the
        # window group for a SlidingWindowSpec group's KV), or None for a group the harness does not model
        # (the second Mamba layout's, .config.Groups.shadow: scheduled and copied, its memory not held)
        self.kinds: tuple[tuple[Literal["kv", "state"], int | None] | None, ...] = ()
        self.request_of: dict[int, str] = {}  # load job -> request (from the metadata, for the transfers' names)
        self.jobs: dict[int, _Job] = {}
        self.by_transfer: dict[int, int] = {}  # transfer id -> job id
        self.now: list[Transfer] = []  # for this step's plan
        self.later: list[Transfer] = []  # asynchronous stores: read at the start of the next step
        self.waited: set[int] = set()  # jobs vLLM waits for before this step's computation
        self.finished: list[TransferResult] = []
        self._next_id = 0

    def bind_groups(self, kv_cache_config) -> None:
        roles = Groups.of(kv_cache_config)
        kinds: list[tuple[Literal["kv", "state"], int | None] | None] = []
        for g in self.spec.config.groups:
            if g.group_id in roles.windows:
                kinds.append(("kv", roles.windows.index(g.group_id)))
            elif g.group_id == roles.attn:
                kinds.append(("kv", None))
            elif g.group_id == roles.mamba:
                kinds.append(("state", None))
            else:
                assert g.group_id in roles.shadow, (g.group_id, roles)
                kinds.append(None)
        self.kinds = tuple(kinds)

    # -- OffloadingWorker --------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec) -> bool:
        self._submit(job_id, "offload", src_spec, [int(c) for c in dst_spec.block_ids], None)
        return True

    def submit_load(self, job_id: int, src_spec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        self._submit(job_id, "load", dst_spec, [int(c) for c in src_spec.block_ids], self.request_of.pop(job_id, None))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """vLLM blocks until these jobs are done before the step computes: their
        stores are read at the start of this step (loads always are)."""
        self.waited |= set(job_ids)
        keep: list[Transfer] = []
        for t in self.later:
            (self.now if self.by_transfer.get(t.id) in job_ids else keep).append(t)
        self.later = keep

    # -- the harness's side ------------------------------------------------------------
    def _submit(self, job_id: int, direction: Literal["offload", "load"], gpu: GPULoadStoreSpec, chunks: list[int],
                request_id: str | None) -> None:
        blocks = [int(b) for b in gpu.block_ids]
        kinds = [kind for kind, n in zip(self.kinds, gpu.group_sizes) for _ in range(n)]
        # One chunk per block (blocks_per_chunk = 1); a load of a chunk wider than its
        # first block would skip part of it (GPULoadStoreSpec.block_indices), never here.
        if len(blocks) != len(chunks) or len(kinds) != len(blocks):
            raise AssertionError(f"job {job_id}: {len(blocks)} blocks, {len(chunks)} chunks, group sizes "
                                 f"{list(gpu.group_sizes)}")
        job = self.jobs[job_id] = _Job(request_id, set())
        for role, block, chunk in zip(kinds, blocks, chunks):
            if role is None:
                continue  # a shadow Mamba group's copy: its memory is not the harness's
            self._next_id += 1
            t = Transfer(self._next_id, direction, role[0], f"cpu{chunk}", block, request_id, window_group=role[1])
            job.transfers.add(t.id)
            self.by_transfer[t.id] = job_id
            (self.later if direction == "offload" and job_id not in self.waited else self.now).append(t)
        if not job.transfers:
            self.finished.append(TransferResult(job_id, True))
            del self.jobs[job_id]

    def take(self) -> tuple[Transfer, ...]:
        """This step's transfers (stores first, as the transport runs them anyway)."""
        out, self.now = self.now, []
        self.waited = set()
        return tuple(out)

    def defer(self) -> None:
        """The step computed: asynchronous stores submitted in it are read now, at the next step's start."""
        self.now = self.later + self.now
        self.later = []

    def complete(self, done: tuple[TransferDone, ...]) -> None:
        for d in done:
            job_id = self.by_transfer.pop(d.id, None)
            if job_id is None:
                continue  # not ours, or reported twice
            job = self.jobs[job_id]
            job.transfers.discard(d.id)
            job.ok &= d.ok  # vLLM's CPU worker has no check of the bytes: a copy that completes succeeded
            if not job.transfers:
                del self.jobs[job_id]
                self.finished.append(TransferResult(job_id, job.ok))

    def busy(self) -> bool:
        return bool(self.jobs)


@dataclass
class OffloadingTier:
    """The worker role of vLLM's ``OffloadingConnector``, driven as vLLM's model
    runner drives it (``kv_connector_model_runner_mixin.py`` and
    ``gpu_model_runner.py``: ``handle_preemptions`` before the forward,
    ``start_load_kv``, ``wait_for_save`` after it, ``get_finished`` and the
    worker metadata into the step's ``KVConnectorOutput``)."""

    scheduler_connector: Any  # vLLM's OffloadingConnector, scheduler role (Scheduler.connector)
    worker_connector: Any  # the same class, worker role
    worker: HarnessOffloadingWorker
    policy: str
    bound: bool = False
    stats: dict = field(default_factory=lambda: {"store_jobs": 0, "load_jobs": 0, "flushed": 0,
                                                  "host_evictions": 0})

    @classmethod
    def build(cls, scheduler, vllm_config, kv_cache_config, policy: str) -> OffloadingTier:
        worker_connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        role = worker_connector.connector_worker
        assert role is not None and isinstance(role.spec, HarnessOffloadingSpec), role
        # register_kv_caches canonicalizes the device tensors for the stock worker;
        # the harness's memory is its own, so the worker is created directly.
        worker = HarnessOffloadingWorker(role.spec)
        worker.bind_groups(kv_cache_config)
        role.worker = worker
        tier = cls(scheduler.connector, worker_connector, worker, policy)
        policy_obj = tier.manager._policy
        evict = policy_obj.evict

        def counted(n, protected):  # observes vLLM's policy, changes nothing
            out = evict(n, protected)
            tier.stats["host_evictions"] += len(out or ())
            return out

        policy_obj.evict = counted
        return tier

    @property
    def manager(self):
        return self.scheduler_connector.connector_scheduler.manager

    def bind_adapter(self, adapter) -> None:  # the store connector's interface (adapter.py)
        pass

    def host_listing(self, registry) -> tuple[HostCached, ...]:
        """The chunks vLLM's manager holds ready (``complete_store`` ran: a lookup
        may hit them from now on) as the contract's host listing: the chunk's
        harness key, the prefix its ``OffloadKey``'s block hash covers (the
        adapter's hash registry; a hash it never saw is left out) and the memory
        of its group.  The manager's own structures, read, not changed: the LRU
        policy's ``chunks``, the ARC policy's ``t1`` and ``t2`` (its ghost lists
        hold no chunk).  A drafter group's partial tail is keyed at its EAGLE
        proof, past what its block holds (scheduler.py ``_partial_tail_key_tokens``):
        such groups are left out."""
        policy = self.manager._policy
        chunks = getattr(policy, "chunks", None)
        items = list(chunks.items()) if chunks is not None else [*policy.t1.items(), *policy.t2.items()]
        config = self.scheduler_connector.connector_scheduler.config
        eagle = {g.group_idx for g in config.kv_group_configs if g.is_eagle_group}
        roles = {g.group_id: kind for g, kind in zip(self.worker.spec.config.groups, self.worker.kinds)}
        out = []
        for key, chunk in items:
            group = get_offload_group_idx(key)
            role = roles.get(group)
            if not chunk.is_ready or role is None or group in eagle:
                continue
            prefix = registry.prefixes.get(get_offload_block_hash(key))
            if prefix is not None:
                out.append(HostCached(f"cpu{chunk.chunk_id}", prefix, role[0], role[1]))
        return tuple(out)

    def busy(self) -> bool:
        return self.worker.busy() or bool(self.worker.later) or bool(self.worker.now)

    def transfers(self, so) -> tuple[Transfer, ...]:
        """Before the step computes: deferred stores, flushes and this step's loads."""
        meta = so.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata), meta
        self.stats["store_jobs"] += len(meta.store_jobs)
        self.stats["load_jobs"] += len(meta.load_jobs)
        self.stats["flushed"] += len(meta.jobs_to_flush or ())
        self.worker.request_of = {jid: job.req_id for jid, job in meta.load_jobs.items()}
        self.worker_connector.handle_preemptions(meta)
        self.worker_connector.bind_connector_metadata(meta)
        self.worker_connector.start_load_kv(None)
        self.bound = True
        if not so.total_num_scheduled_tokens:
            self.worker.defer()  # nothing computes in this step: no source can change before the stores read it
        return self.worker.take()

    def complete(self, done: tuple[TransferDone, ...]) -> None:
        self.worker.complete(done)

    def save_step(self, plan) -> None:
        """After the step computed: its store jobs are queued for the next step
        (``wait_for_save``), and the stores submitted before it become due."""
        self.worker.defer()
        self._finalize()

    def _finalize(self) -> None:
        if self.bound:
            self.worker_connector.wait_for_save()
            self.bound = False

    def connector_output(self) -> KVConnectorOutput:
        self._finalize()
        recving = self.worker_connector.get_finished(set())[1]
        meta = self.worker_connector.build_connector_worker_meta()
        self.worker_connector.clear_connector_metadata()
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta)
