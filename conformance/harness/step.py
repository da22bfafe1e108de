"""One engine step of a session: ``schedule()``, the plan checked against
the contract (ids, ranges, return types), executed by the runner, the
oracle's verdict on each computed request step measured and recorded,
``update()`` told what was sampled and which transfers completed; the
checkers shown each moment (scheduled, computed, stepped).  A plan that
computes nothing is progress when it moves something (transfers, copies, a
load in flight) and a stall after :data:`STALL_STEPS` of them otherwise.

A mixin of :class:`~conformance.harness.session.Session`: the step is its
idea, the session's state is the session's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from conformance.contract import CacheView, ContractError, Layout, StepPlan, StepResult
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Scheduled, StepRecord
from conformance.harness.conflicts import plan_conflicts

if TYPE_CHECKING:
    from conformance.harness.checker import CheckerSet
    from conformance.harness.history import History
    from conformance.harness.memory import Prefix
    from conformance.harness.observation import Track
    from conformance.harness.oracle import Oracle
    from conformance.harness.runner import Runner
    from conformance.harness.speculation import Speculator

STALL_STEPS = 3


class Stepping:
    """The session's engine step (see the module's docstring)."""

    if TYPE_CHECKING:  # what it uses of the session
        oracle: Oracle
        checkers: CheckerSet
        history: History
        runner: Runner
        speculator: Speculator
        tracks: dict[str, Track]
        layout: Layout
        step_no: int
        _stalled: int
        last_view: CacheView | None
        plan_view: CacheView | None
        last_plan: StepPlan | None

        def call(self, method: str, *args: object): ...

        def active(self) -> list[str]: ...

        def _settle(self) -> CacheView: ...

        def _view(self) -> CacheView: ...

    def _step(self, budget: int, transfers: bool = False) -> None:
        """One step; with ``transfers``, also one without an active request
        while transfers are in flight (they complete only in a step)."""
        if not self.active() and not (transfers and self.runner.transport.busy()):
            return
        view_before = self.last_view
        plan: StepPlan = self.call("schedule", budget)
        if not isinstance(plan, StepPlan):
            raise ConformanceFailure("contract", f"schedule() returned {type(plan).__name__}, not StepPlan")
        self.step_no += 1
        self.last_plan = plan
        self.history.plan(plan)
        if not plan.requests:
            self._without_requests(plan)
            return
        self._stalled = 0
        view = self.plan_view = self._view()
        self._validate(plan)
        self.checkers.notify(Scheduled(plan, view))
        try:
            executed = self.runner.execute(plan, {rid: t.tokens for rid, t in self.tracks.items()})
        except ContractError as exc:
            raise ConformanceFailure("contract", str(exc)) from None
        self._record_transfers()
        sampled: dict[str, int] = {}
        accepted: dict[str, int] = {}
        self.speculator.last = {}
        for ex in executed:
            rs, track = ex.step, self.tracks[ex.step.request_id]
            if ex.logits is not None:  # the oracle's verdict, recorded; the logits checker judges it
                # a verification step's logits continue through its drafts
                verdict = self.oracle.judge(track.tokens + tuple(rs.drafts), rs.start, ex.logits)
                self.history.judged(rs, verdict, ex.reads)
                ex = replace(ex, verdict=verdict)
            self.checkers.notify(ex)
            at_end = rs.end == len(track.tokens)
            n = self.speculator.accept(self, rs, track)  # drafts accepted: the sequence grows by them
            if rs.drafts:
                accepted[rs.request_id] = n
                self.runner.commit_snapshots(rs.request_id, rs.end + n)
            track.computed = rs.end + n
            track.steps += 1
            if at_end and track.generated < track.max_new:
                tok = self.oracle.next_token(track.tokens)
                track.tokens += (tok,)
                track.generated += 1
                sampled[rs.request_id] = tok
        finished = self.call("update", plan, StepResult(sampled, transfers=tuple(self.runner.completed),
                                                        accepted=accepted))
        self._finish(list(finished or ()))
        view_after = self._settle()
        self.checkers.notify(StepRecord(self.step_no, plan, view_before, view, view_after, tuple(finished or ()),
                                        tuple(self.runner.completed)))

    def _without_requests(self, plan: StepPlan) -> None:
        """A plan that computes nothing: transfers and copies only, or a stall."""
        progress = bool(plan.transfers or plan.kv_copies or plan.state_copies or self.runner.transport.busy())
        # Requests that wait on loads were matched in this schedule: the
        # checkers see what the cache held then (an entry evicted by another
        # request's load destinations is neither on the device nor, its
        # offload not run yet, in the host store).
        self.checkers.notify(Scheduled(plan, self._view() if progress else None))
        if progress:
            # requests wait for their loads (or copies prepare them): progress, not a stall
            self._stalled = 0
            try:
                self.runner.execute(plan, {})
            except ContractError as exc:
                raise ConformanceFailure("contract", str(exc)) from None
            self._record_transfers()
            if self.call("update", plan, StepResult(transfers=tuple(self.runner.completed))):
                raise ConformanceFailure("contract", "update() finished requests in a step that computed nothing")
            self._settle()
            return
        self._stalled += 1
        if self._stalled >= STALL_STEPS:
            raise ConformanceFailure("stall", f"{len(self.active())} requests active but nothing was scheduled "
                                              f"for {STALL_STEPS} steps")

    def _finish(self, finished: list[str]) -> None:
        for rid in finished:
            track = self.tracks.get(rid)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"update() reported {rid!r} finished, but it is not active")
            if track.generated < track.max_new:
                raise ConformanceFailure("contract", f"update() finished {rid!r} after {track.generated} of "
                                                     f"{track.max_new} tokens")
            track.done = True
        self.history.finished(finished)
        late = [rid for rid, t in self.tracks.items() if not t.done and t.generated >= t.max_new]
        if late:
            raise ConformanceFailure("contract", f"requests {late} generated all their tokens but update() did "
                                                 f"not report them finished")

    def _record_transfers(self) -> None:
        for done in self.runner.completed:
            self.history.completed(done, self.runner.transport.intact.pop(done.id, None))

    def _readmitted(self, plan: StepPlan, rs, tokens: tuple[int, ...]) -> bool:
        """A step past the request's computed tokens is a re-admission: vLLM
        resumes a preempted request from a cache hit, which may be another
        request's longer prefix.  Right only when the state the step starts
        from (its slot for RESUME, the source for each part a copy takes) is,
        by memory's provenance, the state at its start (a skip is not)."""
        init = rs.state_init
        if init.kind == "fresh":  # zeroes: the state at 0 only
            return False
        mem = self.runner.memory
        slots = range(mem.layout.num_state_slots)
        # What each slot holds once the plan's copies ran, in their order, as the runner runs
        # them (a chain, or a second copy onto the same slot, is judged on its last write).
        held: dict[int, tuple[Prefix | None, Prefix | None]] = {}

        def holds(slot: int) -> tuple[Prefix | None, Prefix | None]:
            return held[slot] if slot in held else mem.state_holds(slot)

        for a, b in plan.state_copies:
            if a not in slots or b not in slots:
                return False
            held[b] = holds(a)
        src = rs.state_slot if init.source is None else init.source
        if src not in slots or rs.state_slot not in slots:
            return False
        want = tokens[: rs.start]
        conv = holds(src if "conv" in init.parts else rs.state_slot)[0]
        ssm = holds(src if "ssm" in init.parts else rs.state_slot)[1]
        return conv == want and ssm == want

    def _in_range(self, plan: StepPlan) -> None:
        """Every block and slot the plan names is in the pool, said as such
        before any checker judges the plan (a block id past the pool read as
        "refcount 0 while in use" when the checkers saw it first)."""
        mem, B, lay = self.runner.memory, self.layout.block_size, self.layout

        def check(who: str, valid, ids) -> None:
            try:
                for i in ids:
                    valid(i)
            except ContractError as exc:
                raise ConformanceFailure("contract", f"{who}{exc}: out of range (the pool has {lay.num_kv_blocks} "
                                                     f"KV blocks and {lay.num_state_slots} state slots)") from None

        check("a KV copy: ", mem.check_block, [b for pair in plan.kv_copies for b in pair])
        check("a state copy: ", mem.check_slot, [s for pair in plan.state_copies for s in pair])
        for rs in plan.requests:
            check(f"{rs.request_id}: ", mem.check_block, rs.block_table[: -(-rs.end // B)])
            sources = [rs.state_init.source] if rs.state_init.source is not None else []
            check(f"{rs.request_id}: ", mem.check_slot, [rs.state_slot, *sources, *(s for _, s in rs.snapshots)])

    def _validate(self, plan: StepPlan) -> None:
        seen: set[str] = set()
        for rs in plan.requests:
            if rs.request_id in seen:
                raise ConformanceFailure("contract", f"request {rs.request_id} scheduled twice in one step")
            seen.add(rs.request_id)
            track = self.tracks.get(rs.request_id)
            if track is None or track.done:
                raise ConformanceFailure("contract", f"scheduled {rs.request_id!r}, which is not active")
            if track.computed is None:
                if rs.start >= track.prompt_len:
                    raise ConformanceFailure("contract", f"{rs.request_id}: first step starts at {rs.start}, but "
                                                         f"the prompt has {track.prompt_len} tokens")
            elif rs.start > track.computed and not self._readmitted(plan, rs, track.tokens):
                raise ConformanceFailure("contract", f"{rs.request_id}: step starts at {rs.start}, but only "
                                                     f"{track.computed} tokens were computed")
            self.speculator.validate(rs, track)
        self._in_range(plan)
        problems = plan_conflicts(plan, self.layout.block_size, {rs.request_id: self.tracks[rs.request_id].tokens
                                                                 for rs in plan.requests})
        if problems:  # memory two requests of the step contend for (conformance/harness/conflicts.py)
            more = f" (+{len(problems) - 2} more)" if len(problems) > 2 else ""
            raise ConformanceFailure("contract", "; ".join(problems[:2]) + more)
