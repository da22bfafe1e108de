"""A second storage tier through vLLM's own KV connector API.

``HarnessStoreConnector`` is a real ``KVConnectorBase_V1`` + ``SupportsHMA``
connector, created by vLLM's scheduler from a ``KVTransferConfig``, so the
scheduler's reconciliation of a local hit with an external one (block-aligned
offer, sub-block tail dropped when the remote is longer, ties stay local, the
divergent-hybrid path) and its asynchronous-load path
(``WAITING_FOR_REMOTE_KVS``, ``finished_recving`` / ``failed_recving``, the
recompute policy) are vLLM's code, exercised as they are.

The store is the harness's host tier (:mod:`conformance.harness.transport`): the
connector never touches memory, it only issues the contract's
:class:`~conformance.contract.Transfer` s and reads their completions, so the
environment faults (lost entries, failed, short, corrupted or late transfers)
apply to it exactly as to any other implementation's tier.

- save: after a step, every full attention block a request computed, and its
  running state when the step ends on a block boundary, become ``offload``
  transfers.  They run at the start of the next step (before anything can
  overwrite their sources), and an entry counts as stored only once its
  offload completed, with the checksum of its source bytes.
- claim (scheduler side): the longest block-aligned p < num_tokens such that
  every KV block in [offered, p) and the state at p are stored.  A request
  whose load failed once is not offered the tier again (a failing tier cannot
  starve it).
- load: the KV blocks of [offered, p) into the request's attention blocks, and
  the state at p into the Mamba column (p - 1) // B, where the runner
  (``preprocess_mamba``) will look for it.  Asynchronous by default: the
  request waits in ``WAITING_FOR_REMOTE_KVS`` until every load completed; a
  load that failed or whose landed bytes do not match the stored checksum
  reports the request in ``failed_recving``, and vLLM recomputes it.
  ``{"async": false}`` loads in the step that computes, as vLLM's synchronous
  path does; a failed synchronous load cannot be undone (vLLM has no
  per-block recovery for hybrid layouts), so that mode does not survive
  transfer faults, by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.outputs import KVConnectorOutput

from conformance.contract import Transfer, TransferDone

CONNECTOR_NAME = "HarnessStoreConnector"
DEFAULTS = {"divergent": False, "async": True}


def connector_options(value) -> dict:
    """``--option connector=true`` or ``connector='{"divergent": true}'`` -> the full options."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"connector: expected true or an object like {DEFAULTS}, not {value!r}")
    unknown = set(value) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown connector options {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    return {k: bool(value.get(k, default)) for k, default in DEFAULTS.items()}


def connector_transfer_config(options) -> KVTransferConfig:
    # vLLM's default policy ends a request whose load failed with an error;
    # "recompute" is the one under which a tier failure costs only reuse.
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_module_path=__name__,
                            kv_connector_extra_config=connector_options(options),
                            kv_load_failure_policy="recompute")


def entry_key(kind: str, tokens, p: int) -> str:
    # Keyed by the token prefix, not by vLLM's block hash: that hash chains
    # from a per-process random seed, and keys are recorded in histories and
    # seed the fault triggers, so they must be the same on every replay.
    return f"{kind}:{p}:{hash(tuple(tokens[:p])) & 0xFFFFFFFFFFFF:x}"


@dataclass
class Load:
    request_id: str
    block_ids: tuple[list[int], ...]  # as allocated (the full tables); where the load is written
    begin: int  # the block-aligned local hit the scheduler offered
    end: int  # begin + the external tokens


class HarnessStoreMeta(KVConnectorMetadata):
    def __init__(self, loads: list[Load]):
        self.loads = loads


class HarnessStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        opts = connector_options(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._divergent = opts["divergent"]
        self.load_async = opts["async"]
        self.block_size = vllm_config.cache_config.block_size
        self.adapter: Any = None  # the VllmCache, for the requests' tokens (bind_adapter)
        self.stored: dict[str, str] = {}  # key -> checksum of the source bytes (completed offloads only)
        self.inflight: dict[int, tuple] = {}  # transfer id -> ("offload", key) | ("load", request, key)
        self.offloads: list[Transfer] = []  # issued after a step, run at the start of the next
        self.loading: dict[str, set[int]] = {}  # request -> its loads not completed yet
        self.failed: set[str] = set()  # requests with a failed load in their current round
        self.gave_up: set[str] = set()  # requests whose load failed: the tier is not offered again
        self.recving: set[str] = set()  # completed rounds not reported to the scheduler yet
        self.failed_recving: set[str] = set()
        self._offered: dict[str, int] = {}
        self._pending: list[Load] = []
        self._next_id = 0
        self.log: list[tuple] = []  # (request, offered, claimed) for tests and reports
        self.stats = {"offloads": 0, "stored": 0, "loads": 0, "loaded_tokens": 0, "failed_loads": 0}

    def bind_adapter(self, adapter) -> None:
        self.adapter = adapter

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent

    def busy(self) -> bool:
        """Transfers issued and not completed yet."""
        return bool(self.inflight)

    # -- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid, tokens, B = request.request_id, request.all_token_ids, self.block_size
        best = 0
        # The store keeps the full attention layers' blocks and the recurrent state, not a window group's:
        # with window layers it claims nothing (vLLM would allocate window blocks it never fills).
        if rid not in self.gave_up and not self.adapter.runner.groups.windows:
            p = num_computed_tokens + B
            while p < request.num_tokens:  # at least one token is left to compute
                if entry_key("kv", tokens, p) not in self.stored:
                    break
                if entry_key("state", tokens, p) in self.stored:
                    best = p
                p += B
        claimed = best - num_computed_tokens if best else 0
        self.log.append((rid, num_computed_tokens, claimed))
        self._offered[rid] = num_computed_tokens
        return claimed, self.load_async and claimed > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        begin = self._offered.pop(request.request_id, 0)
        if num_external_tokens:
            self._pending.append(Load(request.request_id, blocks.get_block_ids(), begin, begin + num_external_tokens))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._pending = HarnessStoreMeta(self._pending), []
        return meta

    def request_finished_all_groups(self, request, block_ids):
        # Offloads read their sources at the start of the next step, before
        # anything can be written there: vLLM may free the blocks at once.
        return False, None

    def request_finished(self, request, block_ids):
        return False, None

    # -- worker side: the harness runs the transfers ----------------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:  # loads are Transfers in the plan
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self):
        pass

    def transfers(self, so) -> tuple[Transfer, ...]:
        """The transfers of the step ``so`` describes: the previous step's
        saves, then this step's loads."""
        out, self.offloads = self.offloads, []
        meta = so.kv_connector_metadata
        for load in meta.loads if isinstance(meta, HarnessStoreMeta) else ():
            out += self._loads(load)
        return tuple(out)

    def _loads(self, load: Load) -> list[Transfer]:
        rid, B = load.request_id, self.block_size
        tokens = self.adapter.requests[rid].all_token_ids
        # The harness's groups (.config.Groups): a shadow Mamba group's blocks hold no harness memory.
        groups = self.adapter.runner.groups
        attn, mamba = load.block_ids[groups.attn], load.block_ids[groups.mamba]
        wanted: list[tuple[Literal["kv", "state"], int, int]] = [
            ("kv", (i + 1) * B, attn[i]) for i in range(load.begin // B, load.end // B)]
        wanted.append(("state", load.end, mamba[(load.end - 1) // B]))
        out = []
        for kind, p, device in wanted:
            key = entry_key(kind, tokens, p)
            t = self._issue("load", kind, key, device, rid)
            self.inflight[t.id] = ("load", rid, key)
            self.loading.setdefault(rid, set()).add(t.id)
            out.append(t)
        self.stats["loads"] += 1
        self.stats["loaded_tokens"] += load.end - load.begin
        return out

    def save_step(self, plan) -> None:
        """After a step ran: offload what it computed (sent with the next plan)."""
        B = self.block_size
        queued = {t.key for t in self.offloads} | {i[1] for i in self.inflight.values() if i[0] == "offload"}
        for rs in plan.requests:
            req = self.adapter.requests.get(rs.request_id)
            if req is None:
                continue
            tokens = req.all_token_ids
            wanted: list[tuple[Literal["kv", "state"], int, int]] = [
                ("kv", (i + 1) * B, rs.block_table[i]) for i in range(rs.start // B, rs.end // B)]
            # The states at block boundaries the step leaves behind: a
            # prefill checkpoint exported from inside the step (MambaMixer2's
            # spec: vLLM no longer ends a chunk there, so without these the
            # store would rarely hold a state to claim), and the running
            # state when the step ends on one.
            wanted += [("state", p, slot) for p, slot in rs.snapshots if p % B == 0]
            if rs.end % B == 0:
                wanted.append(("state", rs.end, rs.state_slot))
            for kind, p, device in wanted:
                key = entry_key(kind, tokens, p)
                if key in self.stored or key in queued:
                    continue
                queued.add(key)
                t = self._issue("offload", kind, key, device, rs.request_id)
                self.inflight[t.id] = ("offload", key)
                self.offloads.append(t)
                self.stats["offloads"] += 1

    def complete(self, done: tuple[TransferDone, ...]) -> None:
        """Completions, in any order and possibly a step late; matched by id."""
        for d in done:
            info = self.inflight.pop(d.id, None)
            if info is None:
                continue  # not ours, or reported twice: ignore rather than trust
            if info[0] == "offload":
                if d.ok and d.checksum:
                    self.stored[info[1]] = d.checksum
                    self.stats["stored"] += 1
                continue
            _, rid, key = info
            if not d.ok or d.checksum is None or d.checksum != self.stored.get(key):
                self.failed.add(rid)
                self.stored.pop(key, None)  # lost, short or corrupt: the entry is not trusted again
            waiting = self.loading[rid]
            waiting.discard(d.id)
            if waiting:
                continue
            del self.loading[rid]
            failed = rid in self.failed
            self.failed.discard(rid)
            if failed:
                self.gave_up.add(rid)
                self.stats["failed_loads"] += 1
            if self.load_async:  # a synchronous load's request is already running: nothing to report
                self.recving.add(rid)
                if failed:
                    self.failed_recving.add(rid)

    def connector_output(self) -> KVConnectorOutput | None:
        """What the worker reports to the scheduler: asynchronous loads that
        completed (and which of them failed) since the last report."""
        recving, failed = self.recving, self.failed_recving
        self.recving, self.failed_recving = set(), set()
        return KVConnectorOutput(finished_recving=recving, failed_recving=failed) if recving else None

    def _issue(self, direction: Literal["offload", "load"], kind: Literal["kv", "state"], key: str, device: int,
               rid: str) -> Transfer:
        self._next_id += 1
        return Transfer(self._next_id, direction, kind, key, device, rid)
