"""SchedulerOutput -> StepPlan: the duties of vLLM's worker-side model runner.

vLLM's scheduler tells the runner the chunk sizes, the block tables (as deltas)
and the copy-on-write block copies.  It does *not* list the Mamba state moves:
the runner derives them (``vllm/v1/worker/mamba_utils.py::preprocess_mamba``,
V1 path; with speculative decoding the accepted column too, see
:mod:`.speculative`).  :class:`RunnerState` re-derives exactly that,
because the harness stands where vLLM's GPU model runner would, and that code
cannot be imported on a CPU (it loads Triton kernels).

With prefill checkpoint blocks (``MambaSpec.num_prefill_checkpoint_blocks``,
which MambaMixer2 sets), the scheduler no longer splits a prefill at the
prompt's checkpoint: the worker exports the state at that position from inside
the step into the checkpoint column of the Mamba table.  Where and whether is
decided by vLLM's own ``compute_mamba_prefill_checkpoints``
(model_executor/layers/mamba/checkpoint.py, the function every backend calls so
that it "declines in lockstep with the scheduler and MambaManager"), called
here as the worker calls it.  The contract states that export as a snapshot of
the running state at ``position`` into that slot; the kernels skip a null
destination (``state_idx != NULL_BLOCK_ID``), and so does the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import conformance.adapters.vllm.compat as compat
from conformance.adapters.vllm.config import Groups
from conformance.contract import FRESH, NULL_BLOCK, RESUME, RequestStep, StepPlan, copy_from


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _ReqState:
    tables: list[list[int]]  # per KV cache group, the block ids (grows with deltas)


@dataclass
class RunnerState:
    """What a V1 model runner remembers between steps."""

    mamba_block_size: int
    num_spec_blocks: int = 0
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    checkpoint_blocks: int = 0  # MambaSpec.num_prefill_checkpoint_blocks
    checkpoint_alignment: int | None = None  # MambaSpec.prefill_checkpoint_alignment
    requests: dict[str, _ReqState] = field(default_factory=dict)
    # preprocess_mamba's ``mamba_state_idx``: request -> column of its running state
    mamba_state_idx: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (.speculative): the input batch's num_accepted_tokens
    # (accepted drafts + 1; 1 by default), and what each verification row of the
    # step in flight needs once its acceptance is known: (end, running column).
    num_accepted: dict[str, int] = field(default_factory=dict)
    verifying: dict[str, tuple[int, int]] = field(default_factory=dict)
    drop_eagle_block: bool = False  # MambaPrefillCheckpointBuilder.drop_eagle_block
    num_hash_lookahead_tokens: int = 0
    # Which group's table is the attention layers' and which the recurrent layers' (a shadow Mamba
    # group's table is vLLM's worker's business only: the harness holds no memory of it).
    groups: Groups = field(default_factory=Groups)
    own_slots: dict[str, int] = field(default_factory=dict)  # a model without recurrent layers: a slot each

    @classmethod
    def for_config(cls, vllm_config, kv_cache_config) -> RunnerState:
        """A runner in lockstep with the scheduler built from these configs: the
        worker's prefill checkpoint rules read the hash sizes the engine
        resolved (``MambaPrefillCheckpointBuilder.build``) and the Mamba spec."""
        groups = Groups.of(kv_cache_config)
        # A model without recurrent layers has no Mamba group: the spec of the first group stands in
        # (no checkpoint block, no speculative block; its block size is every group's).
        spec = kv_cache_config.kv_cache_groups[groups.mamba if groups.mamba is not None else 0].kv_cache_spec
        hash_block_size, alignment = compat.checkpoint_hash_sizes(vllm_config.cache_config, spec.block_size)
        return cls(mamba_block_size=spec.block_size, num_spec_blocks=getattr(spec, "num_speculative_blocks", 0),
                   hash_block_size=hash_block_size, cache_hit_alignment_tokens=alignment,
                   checkpoint_blocks=getattr(spec, "num_prefill_checkpoint_blocks", 0),
                   checkpoint_alignment=getattr(spec, "prefill_checkpoint_alignment", None),
                   # checkpoint.py MambaPrefillCheckpointBuilder.__init__ (.compat)
                   drop_eagle_block=compat.drops_eagle_block(vllm_config),
                   num_hash_lookahead_tokens=compat.hash_lookahead_tokens(vllm_config), groups=groups)

    def prev_state_idx(self, rid: str, num_computed: int) -> int:
        """The column holding the state at ``num_computed`` (-1: start fresh).
        A new or resumed request has none remembered: its hit ends at
        ``num_computed``, whose state sits in column (n-1)//B."""
        prev = self.mamba_state_idx.get(rid)
        return (num_computed - 1) // self.mamba_block_size if prev is None else prev

    def to_plan(self, so) -> StepPlan:
        """Apply one SchedulerOutput to the remembered tables; return the plan."""
        # cleanup_mamba_state_idx: finished, preempted and resumed requests
        # forget their running column (a resumed one gets a new table).
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids or ()) | set(resumed):
            self.mamba_state_idx.pop(rid, None)
            self.num_accepted.pop(rid, None)  # the input batch's row goes, and its count with it
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.own_slots.pop(rid, None)

        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _ReqState([list(g) for g in new.block_ids])
            self.mamba_state_idx.pop(new.req_id, None)  # an id reused after an abort is a new request
            self.num_accepted.pop(new.req_id, None)
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            delta = cached.new_block_ids[i]
            if rid in resumed:
                self.requests[rid] = _ReqState([list(g) for g in delta])
            elif delta is not None:
                for table, more in zip(self.requests[rid].tables, delta):
                    table.extend(more)
            starts[rid] = cached.num_computed_tokens[i]

        copies = tuple((c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies or ())
        steps = []
        self.verifying = {}
        spec_tokens = so.scheduled_spec_decode_tokens or {}
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            steps.append(self._request_step(rid, start, start + n, tuple(spec_tokens.get(rid, ()))))
        # One physical page per block id serves whichever group owns it, and
        # vLLM's runner copies a block across *every* layer's cache: so a copy
        # is applied to both the harness's KV blocks and its state slots.
        return StepPlan(requests=tuple(steps), kv_copies=copies, state_copies=copies)

    def _request_step(self, rid: str, start: int, end: int, spec: tuple[int, ...] = ()) -> RequestStep:
        """``end``: the scheduled tokens' end, drafts included; ``spec`` the
        row's scheduled spec tokens (drafts, or ``-1`` padding)."""
        tables = self.requests[rid].tables
        g = self.groups
        # The window groups' tables, vLLM's null block (id 0: it left the window) as the contract's.
        windows = tuple(tuple(NULL_BLOCK if b == 0 else b for b in tables[i]) for i in g.windows)
        attn = tuple(tables[g.attn]) if g.attn is not None else ()
        if g.mamba is None:  # no recurrent layer: a slot of the request's own, never read
            return self._stateless_step(rid, start, end, attn, windows, spec)
        mamba = tables[g.mamba]
        prev = self.prev_state_idx(rid, start)
        # preprocess_mamba: the running state lives in the last non-speculative block.
        num_blocks = cdiv(end, self.mamba_block_size) + self.num_spec_blocks
        curr = num_blocks - 1 - self.num_spec_blocks
        self.mamba_state_idx[rid] = curr
        # The accepted column of the previous verification (accept_token_bias):
        # preprocess_mamba copies it into the new running block, or, where the
        # block did not move, the GDN kernel resumes from it.
        bias = self.num_accepted.get(rid, 1) - 1
        if prev == -1:
            init = FRESH
        elif prev != curr or bias:
            init = copy_from(mamba[prev + bias])  # copy before extend: a cached block is never mutated
        else:
            init = RESUME
        if not spec:
            return RequestStep(rid, start, end, attn, mamba[curr], init,
                               snapshots=self._prefill_checkpoint(mamba, start, end), window_tables=windows)
        # A speculative row: the real token, then the drafts (or padding: a
        # request with one token to compute padded to 1 + k, scheduler.py
        # ~1308-1330; its padding computes nothing the harness could judge and
        # nothing reads, so the step is the real token alone).
        drafts = tuple(t for t in spec if t >= 0)
        real_end = end - len(spec)
        self.verifying[rid] = (real_end, curr)
        B = self.mamba_block_size
        columns = [(real_end + j, mamba[curr + j]) for j in range(len(drafts) + 1)]
        snapshots = []
        for pos, _src in columns:
            # postprocess_mamba_fused_kernel: the accepted boundary column is copied
            # into the block that holds the state at that boundary (a draft
            # position's copy is taken only if the verifier accepts through it).
            dest = pos // B - 1
            if pos % B == 0 and 0 <= dest < len(mamba) and mamba[dest] != 0 and dest != curr + (pos - real_end):
                snapshots.append((pos, mamba[dest]))
        return RequestStep(rid, start, real_end, attn, mamba[curr], init,
                           snapshots=tuple(snapshots), drafts=drafts,
                           draft_slots=tuple(slot for _pos, slot in columns[1:]), window_tables=windows)

    def _stateless_step(self, rid: str, start: int, end: int, attn, windows, spec) -> RequestStep:
        """A step of a model without recurrent layers (gpt-oss's shape): the contract still names a
        running slot; each live request gets one of its own, which no layer reads."""
        if rid not in self.own_slots:
            taken = set(self.own_slots.values())
            self.own_slots[rid] = next(s for s in range(1, len(self.own_slots) + 2) if s not in taken)
        own = self.own_slots[rid]
        drafts = tuple(t for t in spec if t >= 0)
        real_end = end - len(spec)
        if drafts:
            self.verifying[rid] = (real_end, 0)
        return RequestStep(rid, start, real_end if spec else end, attn, own, FRESH if start == 0 else RESUME,
                           drafts=drafts, window_tables=windows)

    def verified(self, rid: str, accepted: int) -> None:
        """After a step: the sampler's count for the row (accepted drafts + 1),
        and postprocess_mamba's reset to 1 where the accepted boundary column
        was copied into the running block itself."""
        real_end, curr = self.verifying.get(rid, (None, None))
        if real_end is None:
            self.num_accepted[rid] = 1
            return
        new = real_end + accepted
        aligned = new // self.mamba_block_size * self.mamba_block_size
        same = aligned >= real_end and aligned // self.mamba_block_size - 1 == curr
        self.num_accepted[rid] = 1 if same else accepted + 1

    def _prefill_checkpoint(self, mamba: list[int], start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The state the worker exports from inside this step, if any
        (``MambaPrefillCheckpointBuilder.build``: only in align mode with
        checkpoint blocks, and only once the hash sizes are resolved)."""
        if not self.checkpoint_blocks or self.hash_block_size is None:
            return ()
        # vLLM's own compute_mamba_prefill_checkpoints, as this release calls it (.compat).
        offset, col = compat.prefill_checkpoint(
            end, end - start, hash_block_size=self.hash_block_size, mamba_block_size=self.mamba_block_size,
            checkpoint_alignment=self.checkpoint_alignment,
            cache_hit_alignment_tokens=self.cache_hit_alignment_tokens, drop_eagle_block=self.drop_eagle_block,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens)
        if not offset:
            return ()
        # _gather_checkpoint_state_indices reads block_table[row, col]; a row is
        # padded with null blocks (0) past the request's table.
        slot = mamba[col] if 0 <= col < len(mamba) else 0
        return ((start + offset, slot),) if slot != 0 else ()
