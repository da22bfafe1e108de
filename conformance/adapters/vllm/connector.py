"""A second storage tier through vLLM's own KV connector API.

``HarnessStoreConnector`` is a real ``KVConnectorBase_V1`` + ``SupportsHMA``
connector, created by vLLM's scheduler from a ``KVTransferConfig``, so the
scheduler's reconciliation of a local hit with an external one (block-aligned
offer, sub-block tail dropped when the remote is longer, ties stay local, the
divergent-hybrid path) is vLLM's code, exercised as is.

The store behind it is harness-side: the harness memory is the "device", and
the store keeps its *own copies* of KV blocks and recurrent states as tensors,
keyed by vLLM's block hash (the chain hash of the prefix), together with the
provenance of those bytes (so a wrong load is explained like any other read).

- save (worker side, after a step ran): every full attention block of a
  scheduled request, under the hash of the prefix that ends with it; the
  running state at the step's end, when that end is a block boundary.
- claim (scheduler side): the longest block-aligned p such that every KV block
  in [offered, p) and the state at p are stored, and p < num_tokens.
- load (worker side, before the step runs): the KV blocks of [offered, p) into
  the request's attention blocks, and the state at p into the Mamba column
  (p - 1) // B, where the runner (``preprocess_mamba``) will look for it.

vLLM's worker runs loads after the block copies of the step; the adapter runs
them when the plan is built, i.e. before the copies.  They never overlap: the
scheduler drops the local sub-block tail (the only source of copies for the
request) whenever an external load is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)

from .config import ATTN_GROUP, MAMBA_GROUP

CONNECTOR_NAME = "HarnessStoreConnector"


def connector_transfer_config(options: dict) -> KVTransferConfig:
    """``options``: ``{"divergent": bool}`` (``supports_divergent_local_hybrid_hits``)."""
    unknown = set(options) - {"divergent"}
    if unknown:
        raise ValueError(f"unknown connector options {sorted(unknown)} (known: divergent)")
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_module_path=__name__,
                            kv_connector_extra_config={"divergent": bool(options.get("divergent", False))})


@dataclass
class Load:
    request_id: str
    block_ids: tuple[list[int], ...]  # as allocated (the full tables); where the load is written
    external: int  # tokens loaded beyond the local hit


class HarnessStoreMeta(KVConnectorMetadata):
    def __init__(self, loads: list[Load]):
        self.loads = loads


@dataclass
class Store:
    """The external tier: tensors copied out of harness memory, keyed by block hash."""

    kv: dict[bytes, tuple[Any, list]] = field(default_factory=dict)  # hash -> (kv[:, block], provenance)
    states: dict[bytes, tuple[Any, Any, Any, Any]] = field(default_factory=dict)  # hash -> conv, ssm, provs
    loads: int = 0
    loaded_tokens: int = 0
    saves: int = 0


class HarnessStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._divergent = bool(extra.get("divergent", False))
        self.block_size = vllm_config.cache_config.block_size
        self.hash_unit = vllm_config.cache_config.prefix_match_unit or self.block_size
        self.store = Store()
        self.adapter = None
        self.memory = None
        self._pending: list[Load] = []
        self.log: list[tuple] = []  # (request, offered, claimed) for tests and reports

    def bind_adapter(self, adapter) -> None:
        self.adapter = adapter

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent

    # -- scheduler side --------------------------------------------------------------
    def _hash_at(self, request, p: int) -> bytes | None:
        k = p // self.hash_unit
        return request.block_hashes[k - 1] if 0 < k <= len(request.block_hashes) and p % self.hash_unit == 0 \
            else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        B, best = self.block_size, 0
        p = num_computed_tokens + B
        while p < request.num_tokens:  # at least one token is left to compute
            kv_key = self._hash_at(request, p)
            if kv_key is None or kv_key not in self.store.kv:
                break
            if kv_key in self.store.states:
                best = p
            p += B
        claimed = best - num_computed_tokens if best else 0
        self.log.append((request.request_id, num_computed_tokens, claimed))
        return claimed, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens:
            self._pending.append(Load(request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._pending = HarnessStoreMeta(self._pending), []
        return meta

    def request_finished_all_groups(self, request, block_ids):
        return False, None  # saves are synchronous: vLLM may free the blocks at once

    def request_finished(self, request, block_ids):
        return False, None

    # -- worker side (run by the adapter on harness memory) ---------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:  # the adapter calls apply_loads instead
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self):
        pass

    def apply_loads(self, so, starts: dict[str, int]) -> None:
        """Write the loads of this step into harness memory (before it runs)."""
        meta = so.kv_connector_metadata
        if not isinstance(meta, HarnessStoreMeta) or not meta.loads:
            return
        mem = self._memory()
        B = self.block_size
        for load in meta.loads:
            req = self.adapter.requests[load.request_id]
            end = starts[load.request_id]  # num_computed_tokens = local + external
            begin = end - load.external
            attn, mamba = load.block_ids[ATTN_GROUP], load.block_ids[MAMBA_GROUP]
            for i in range(begin // B, end // B):
                tensor, prov = self.store.kv[self._hash_at(req, (i + 1) * B)]
                mem.kv[:, attn[i]] = tensor
                mem.kv_prov[attn[i]] = list(prov)
            conv, ssm, conv_p, ssm_p = self.store.states[self._hash_at(req, end)]
            slot = mamba[(end - 1) // B]
            mem.conv[:, slot] = conv
            mem.ssm[:, slot] = ssm
            mem.conv_prov[slot], mem.ssm_prov[slot] = conv_p, ssm_p
            self.store.loads += 1
            self.store.loaded_tokens += load.external

    def save_step(self, plan) -> None:
        """Copy what a step computed out of harness memory (after it ran)."""
        mem = self._memory()
        B = self.block_size
        for rs in plan.requests:
            req = self.adapter.requests.get(rs.request_id)
            if req is None:
                continue
            for i in range(rs.start // B, rs.end // B):
                key = self._hash_at(req, (i + 1) * B)
                if key is not None and key not in self.store.kv:
                    b = rs.block_table[i]
                    self.store.kv[key] = (mem.kv[:, b].clone(), list(mem.kv_prov[b]))
                    self.store.saves += 1
            key = self._hash_at(req, rs.end) if rs.end % B == 0 else None
            if key is not None and key not in self.store.states:
                s = rs.state_slot
                self.store.states[key] = (mem.conv[:, s].clone(), mem.ssm[:, s].clone(), mem.conv_prov[s],
                                          mem.ssm_prov[s])
                self.store.saves += 1

    def _memory(self):
        if self.memory is None:
            raise RuntimeError("the store connector needs the harness memory: call VllmCache.attach_memory(memory) "
                               "after building the Session")
        return self.memory
