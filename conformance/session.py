"""A session: one implementation, one memory, one model, one oracle.

It applies operations (see :mod:`conformance.ops`), drives the implementation
step by step, executes each plan with the runner, judges logits with the
oracle and checks invariants after every step.  Everything it does goes into
its history; the first problem raises :class:`ConformanceFailure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .contract import ContractError, ImplConfig, Layout, Request, StepPlan, StepResult, missing_methods
from .guard import ImplementationError, guarded
from .history import History
from .invariants import check_tables_referenced, check_view
from .memory import Memory
from .model import TinyHybrid
from .ops import Abort, Drain, Op, Step, Submit
from .oracle import Oracle
from .runner import Runner

MAX_DRAIN_STEPS = 400
STALL_STEPS = 3

# Coverage counters every run reports; checks require some of them to be > 0.
COUNTERS = ("steps", "requests", "prefix_hits", "mid_block_hits", "snapshot_reuse", "multi_turn_hits",
            "chunked_prefills", "mid_block_chunk_ends", "evictions", "decode_steps", "aborts",
            "tier_offloads", "tier_loads")  # transfers to and from the host tier that completed ok


class ConformanceFailure(Exception):
    """The implementation produced a wrong result or broke an invariant."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # logits | invariant | contract | raised | timeout | stall


@dataclass
class _Track:
    tokens: tuple[int, ...]
    prompt_len: int
    max_new: int
    continues: str | None
    generated: int = 0
    computed: int | None = None  # None until first scheduled
    steps: int = 0
    done: bool = False


@dataclass
class Session:
    impl: object
    model: TinyHybrid
    oracle: Oracle
    timeout: float | None = 30.0
    history: History = field(default_factory=History)
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # Called after every executed step as obs.after_step(session, plan, view_before, finished):
    # retention checks and metrics read plans and views without touching the core.
    observers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        missing = missing_methods(self.impl)
        if missing:
            raise TypeError(f"{type(self.impl).__name__} does not meet the contract: missing {', '.join(missing)}")
        self.layout: Layout = self._call("layout")
        if not isinstance(self.layout, Layout):
            raise ConformanceFailure("contract", f"layout() returned {type(self.layout).__name__}, not Layout")
        self.memory = Memory(self.layout, self.model.config, self.model.dtype, str(self.model.device))
        self.runner = Runner(self.model, self.memory)
        self.tracks: dict[str, _Track] = {}
        self._cached_before: set = set()
        self._stalled = 0  # consecutive steps that scheduled nothing
        self.last_view = None  # the view after the latest step or abort (before the next schedule)
        self.plan_view = None  # the view taken right after the latest schedule()

    # -- operations ------------------------------------------------------------------
    def apply(self, op: Op) -> None:
        self.history.begin(op)
        if isinstance(op, Submit):
            self._submit(op)
        elif isinstance(op, Step):
            self._step(op.budget)
        elif isinstance(op, Drain):
            self._drain(op.budget)
        elif isinstance(op, Abort):
            self._abort(op.request_id)
        else:
            raise TypeError(f"unknown operation {op!r}")

    def active(self) -> list[str]:
        return [rid for rid, t in self.tracks.items() if not t.done]

    def _submit(self, op: Submit) -> None:
        if op.request_id in self.tracks:
            raise ValueError(f"request id {op.request_id!r} used twice")
        bad = [t for t in op.prompt if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt tokens {bad[:3]} outside the vocabulary of {self.model.config.vocab_size}")
        self.tracks[op.request_id] = _Track(op.prompt, len(op.prompt), op.max_new_tokens, op.continues)
        self.oracle.prime(op.prompt)
        self.coverage["requests"] += 1
        self._call("add_request", Request(op.request_id, op.prompt, op.max_new_tokens))

    def _abort(self, rid: str) -> None:
        track = self.tracks.get(rid)
        if track is None or track.done:
            return
        self._call("abort", rid)
        track.done = True
        self.coverage["aborts"] += 1
        self._check_invariants()

    def _drain(self, budget: int) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.active():
                return
            self._step(budget)
        raise ConformanceFailure("stall", f"requests {self.active()} still active after {MAX_DRAIN_STEPS} steps")

    # -- one engine step --------------------------------------------------------------
    def _step(self, budget: int) -> None:
        if not self.active():
            return
        view_before = self.last_view
        plan: StepPlan = self._call("schedule", budget)
        if not isinstance(plan, StepPlan):
            raise ConformanceFailure("contract", f"schedule() returned {type(plan).__name__}, not StepPlan")
        self.history.plan(plan)
        self.coverage["steps"] += 1
        if not plan.requests and (plan.transfers or self.runner.transport.busy()):
            self._transfers_only(plan)  # requests wait for their loads: progress, not a stall
            return
        if not plan.requests:
            self._stalled += 1
            if self._stalled >= STALL_STEPS:
                raise ConformanceFailure("stall", f"{len(self.active())} requests active but nothing was scheduled "
                                                  f"for {STALL_STEPS} steps")
            return
        self._stalled = 0
        view = self.plan_view = self._call("view")
        self._fail_if("invariant", check_tables_referenced(view, plan, self.layout.block_size))
        self._validate(plan)
        self._count_before(plan)
        try:
            executed = self.runner.execute(plan, {rid: t.tokens for rid, t in self.tracks.items()})
        except ContractError as exc:
            raise ConformanceFailure("contract", str(exc)) from None
        sampled = {}
        for ex in executed:
            rs, track = ex.step, self.tracks[ex.step.request_id]
            verdict = self.oracle.judge(track.tokens, rs.start, ex.logits)
            self.history.judged(rs, verdict, ex.reads)
            if not verdict.ok:
                raise ConformanceFailure(
                    "logits", f"request {rs.request_id} positions [{rs.start}, {rs.end}): logits differ from the "
                              f"no-cache reference by {verdict.max_rel_error:.3g} (relative) from position "
                              f"{verdict.first_bad_position}; reads: {ex.reads}")
            track.computed = rs.end
            track.steps += 1
            if rs.end == len(track.tokens) and track.generated < track.max_new:
                tok = self.oracle.next_token(track.tokens)
                track.tokens += (tok,)
                track.generated += 1
                sampled[rs.request_id] = tok
        finished = self._call("update", plan, StepResult(sampled, transfers=tuple(self.runner.completed)))
        for rid in finished or ():
            track = self.tracks.get(rid)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"update() reported {rid!r} finished, but it is not active")
            if track.generated < track.max_new:
                raise ConformanceFailure("contract", f"update() finished {rid!r} after {track.generated} of "
                                                     f"{track.max_new} tokens")
            track.done = True
        late = [rid for rid, t in self.tracks.items() if not t.done and t.generated >= t.max_new]
        if late:
            raise ConformanceFailure("contract", f"requests {late} generated all their tokens but update() did "
                                                 f"not report them finished")
        self._check_invariants()
        for obs in self.observers:
            obs.after_step(self, plan, view_before, list(finished or ()))

    def _transfers_only(self, plan: StepPlan) -> None:
        try:
            done = self.runner.run_transfers(plan)
        except ContractError as exc:
            raise ConformanceFailure("contract", str(exc)) from None
        if self._call("update", plan, StepResult(transfers=tuple(done))):
            raise ConformanceFailure("contract", "update() finished requests in a step that computed nothing")
        self._check_invariants()

    def _validate(self, plan: StepPlan) -> None:
        for rs in plan.requests:
            track = self.tracks.get(rs.request_id)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"scheduled {rs.request_id!r}, which is not active")
            if track.computed is None:
                if rs.start >= track.prompt_len:
                    raise ConformanceFailure("contract", f"{rs.request_id}: first step starts at {rs.start}, but "
                                                         f"the prompt has {track.prompt_len} tokens")
            elif rs.start > track.computed:
                raise ConformanceFailure("contract", f"{rs.request_id}: step starts at {rs.start}, but only "
                                                     f"{track.computed} tokens were computed")

    def _count_before(self, plan: StepPlan) -> None:
        B = self.layout.block_size
        c = self.coverage
        for rs in plan.requests:
            track = self.tracks[rs.request_id]
            first = track.computed is None
            if first and rs.start > 0:
                c["prefix_hits"] += 1
                c["mid_block_hits"] += rs.start % B != 0
                if track.continues is not None:
                    c["multi_turn_hits"] += 1
            if rs.state_init.kind == "copy" and rs.start > 0 and first:
                c["snapshot_reuse"] += 1
            if rs.end < track.prompt_len:
                c["chunked_prefills"] += first
                c["mid_block_chunk_ends"] += rs.end % B != 0
            if rs.start >= track.prompt_len:
                c["decode_steps"] += 1

    def _check_invariants(self) -> None:
        done = self.runner.transport.succeeded
        self.coverage["tier_offloads"], self.coverage["tier_loads"] = done["offload"], done["load"]
        view = self.last_view = self._call("view")
        cached = {("kv", e.block, e.tokens) for e in view.cached_kv} | {("s", e.slot, e.tokens) for e in view.cached_states}
        self.coverage["evictions"] += len(self._cached_before - cached)
        self._cached_before = cached
        self._fail_if("invariant", check_view(view, self.memory,
                                                 # memory held for a transfer in flight is not leaked
                                                 idle=not self.active() and not self.runner.transport.busy()))

    def _fail_if(self, kind: str, problems: list[str]) -> None:
        if problems:
            raise ConformanceFailure(kind, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))

    def _call(self, method: str, *args):
        return guarded(f"{type(self.impl).__name__}.{method}()", getattr(self.impl, method), *args,
                       timeout=self.timeout)


def make_session(impl_factory, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
                 timeout: float | None = 30.0) -> Session:
    impl = guarded(f"building {getattr(impl_factory, '__name__', impl_factory)}", impl_factory, impl_config,
                   timeout=timeout)
    return Session(impl, model, oracle, timeout=timeout)


__all__ = ["ConformanceFailure", "ImplementationError", "Session", "make_session", "COUNTERS"]
