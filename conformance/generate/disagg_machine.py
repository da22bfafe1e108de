"""The disaggregated state machine: Hypothesis drives a prefill worker, a
decode worker and the transfer between them.

One exported class that takes the disaggregated implementation under test
(a factory ``ImplConfig -> implementation`` planning for two workers, see
:mod:`conformance.disagg.contract`), as :class:`~.machine.HybridCacheMachine`
takes a single-worker one::

    from hypothesis.stateful import run_state_machine_as_test
    from conformance.generate.disagg_machine import DisaggMachine

    run_state_machine_as_test(lambda: DisaggMachine(MyDisagg))

Rules only turn Hypothesis draws into the disaggregated operations
(:mod:`conformance.harness.disagg.ops`) and hand them to a
:class:`~conformance.harness.disagg.session.DisaggSession` (every call into
the implementation guarded with ``timeout``), whose checkers
(:func:`conformance.judge.disagg.disagg_checkers`) judge every step: logits
against the no-cache reference, every byte a decode step reads audited,
nothing held once every request finished.  A failing example is therefore
its operation list: data that ``replay`` runs without Hypothesis; its
explanation is the tail of the session's history.

What the rules draw:

- the layout pairing (prefill 2 state shards and 16-token blocks -> decode 1
  and 32, and the reverse), unless the machine is bound to one;
- prompts whose transferred prefix ends on a block boundary, one token either
  side, or mid-block -- relative to *either* worker's block size, so a prompt
  can end on a prefill boundary and inside a decode block; mid-block is
  inside a block of both;
- prompts that share a prefix (the whole prompt, whole prefill blocks, or
  diverging mid-block) with earlier ones: prefill-side prefix hits before the
  transfer;
- decode continuing for up to 4 tokens; single steps, so transfers (one chunk
  per step) stay in flight while other requests decode on reused pages, and
  staggered pairs (``overlap``) where that happens by construction; aborts,
  some of a request whose transfer is in flight;
- environment faults on the next transfer (``faults``: a killed peer, a
  dropped descriptor, a truncated tail, corrupted bytes, reordered
  completions, a lost notification), which a correct implementation survives.
  The dtype mismatch fires at the metadata exchange, before any rule: it is a
  transport option (``FaultSpec``), not a rule.

Each example ends with a drain (a recorded operation), so every request
finishes and the leak check runs.  Prompt lengths are computed from the
workers' real block sizes (the layouts the implementation asked for), so the
rules need no configuration to be defined.

Workers: with ``workers`` (a :class:`~conformance.harness.disagg.workers.WorkerPool`)
every example reuses the pool's workers, reset to fresh poison, so a check
starts its NIXL peer process once per pairing; without, each example builds
its own.
"""

from __future__ import annotations

import time

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conformance.contract import ImplConfig
from conformance.disagg.contract import DECODE, PREFILL
from conformance.errors import Abandoned, ConformanceFailure, ImplementationError
from conformance.generate.recorder import Recorder
from conformance.harness.disagg import ops as dops
from conformance.harness.disagg.session import DisaggSession
from conformance.harness.disagg.workers import WorkerPool
from conformance.harness.ops import op_to_dict
from conformance.harness.oracle import Oracle
from conformance.judge.disagg import COUNTERS, judged_disagg_session
from conformance.model import ModelConfig, TinyHybrid

PAIRING_NAMES = tuple(sorted(dops.PAIRINGS))
# Where the transferred prefix (prompt minus its last token: prefill stops at
# N-1) ends, relative to a block of the anchor worker; "mid" is inside a block
# of both workers (half the smaller block past a boundary of the anchor's).
# The first value of each is what Hypothesis's simplest example draws and what
# shrinking moves toward: a mid-block prompt taken whole from the common prefix.
# Hypothesis always runs its simplest example first, and it picks the first rule
# whose precondition holds in its own order (fewest arguments first, then by
# name): arm_fault or drain when busy, else ``overlap`` (twice), then ``submit``.
# So the simplest example of either pairing is "overlap, arm, drain, overlap, arm,
# drain, submit, drain, ...": mid-block and on-boundary prefixes transferred shard
# by shard, prefill-side hits, a transfer in flight while another request decodes,
# failed transfers recomputed -- every situation the check requires, for any seed;
# the random examples after it explore the rest.
ENDS = ("mid", "on", "before", "after")
# ``submit`` starts from the boundary instead, so the simplest example also
# transfers prefixes that end exactly on a block of both workers.
SUBMIT_ENDS = ("on", "before", "after", "mid")
# How a prompt shares the scenario's common prefix: not at all, entirely, up to
# one or two prefill blocks, or diverging mid-block (a hit stops at the block).
SHARES = ("whole", "none", "one-block", "two-blocks", "mid-block")
MAX_ACTIVE = 3
MAX_OVERLAPS = 2  # per example: the rest of it is free draws
MAX_ARMS = 2  # faults armed per example (a lost notification costs its deadline, a killed peer a restart)


def _abandon_on_hang(exc: Exception) -> None:
    """A hang abandons the check at once, as in the single-worker machine
    (``rules/base.py``): :class:`Abandoned` passes through Hypothesis, which
    would otherwise replay the example (and wait out the timeout again)."""
    if isinstance(exc, ImplementationError) and exc.kind == "timeout":
        raise Abandoned(exc) from None


def recorder_for_disagg(**kwargs) -> Recorder:
    """A :class:`Recorder` whose coverage counts the disaggregated session's counters."""
    return Recorder(coverage=dict.fromkeys(COUNTERS, 0), **kwargs)


class DisaggMachine(RuleBasedStateMachine):
    """``DisaggMachine(disagg_factory, model=..., oracle=..., pairing=...,
    impl_options=..., transport=..., workers=..., faults=..., recorder=...,
    timeout=...)``."""

    session: DisaggSession

    def __init__(self, disagg_factory, *, model: TinyHybrid | None = None, oracle: Oracle | None = None,
                 pairing: str | None = None, impl_options: dict | None = None, transport: str = "auto",
                 workers: WorkerPool | None = None, faults: tuple[str, ...] = dops.ARMABLE,
                 recorder: Recorder | None = None, max_active: int = MAX_ACTIVE, timeout: float | None = 30.0):
        super().__init__()
        if pairing is not None and pairing not in dops.PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(PAIRING_NAMES)}, got {pairing!r}")
        unknown = [f for f in faults if f not in dops.ARMABLE]
        if unknown:
            raise ValueError(f"faults that cannot be armed mid-run: {', '.join(unknown)}; "
                             f"armable: {', '.join(dops.ARMABLE)}")
        self.factory = disagg_factory
        self.model = model or TinyHybrid(ModelConfig())
        self.oracle = oracle or Oracle(self.model)
        self.fixed_pairing = pairing
        self.impl_options = dict(impl_options or {})
        self.transport = transport
        self.pool = workers
        self.faults = tuple(faults)
        self.recorder = recorder or recorder_for_disagg()
        self.max_active = max_active
        self.timeout = timeout
        self.session = None  # type: ignore[assignment]
        self.ops: list[dops.DisaggOp] = []
        self.next_id = 0
        self.failed = False
        self.overlaps = 0
        self.arms = 0
        self.next_fault: str | None = None
        self.armed_at: int | None = None  # submission index the armed fault fires on
        self.transport_name = self.transport_why = ""
        self.recorder.examples += 1

    # -- plumbing ---------------------------------------------------------------------------
    @initialize(pairing=st.sampled_from(PAIRING_NAMES))
    def start(self, pairing):
        self.pairing = self.fixed_pairing or pairing
        self.impl_config = ImplConfig(options={**dops.PAIRINGS[self.pairing], **self.impl_options})

    def open(self) -> DisaggSession:
        """The session, built when the first operation needs it: Hypothesis runs
        examples that never get past their first choice, and an implementation
        (two vLLM schedulers) and a reset of the workers are not free."""
        if self.session is None:
            try:
                self.session = judged_disagg_session(self.factory, self.impl_config, self.model, self.oracle,
                                                     self.transport, pool=self.pool, timeout=self.timeout)
            except ImplementationError as exc:  # building it raised or hung
                self.failed = True
                _abandon_on_hang(exc)
                raise
            self.transport_name, self.transport_why = self.session.transport_name, self.session.transport_why
            note(f"pairing {self.pairing}: {self.impl_config.options} over {self.transport_name}")
            layouts = self.session.layouts
            self.block: dict[str, int] = {PREFILL: layouts.prefill.block_size, DECODE: layouts.decode.block_size}
        return self.session

    def apply(self, op: dops.DisaggOp) -> None:
        note(repr(op))
        self.ops.append(op)
        self.recorder.steps += 1
        try:
            self.session.apply(op)
        except (ConformanceFailure, ImplementationError) as exc:
            self.failed = True
            rec = self.recorder
            rec.failure = (exc, [op_to_dict(o) for o in self.ops], self.session.history.tail(64))
            if rec.first_failure is None:
                rec.first_failure = (rec.examples, round(time.perf_counter() - rec.started, 3))
            _abandon_on_hang(exc)
            raise

    def teardown(self):
        try:
            if self.session is not None and not self.failed and (self.active() or self.session.in_flight_requests()):
                self.apply(dops.DisaggDrain())  # every request finishes: the checkers see it at rest
        finally:
            if self.session is not None:
                for k, v in self.session.coverage.items():
                    self.recorder.coverage[k] = self.recorder.coverage.get(k, 0) + v
                self.recorder.notes |= self.session.notes
                self.session.close()
            if self.recorder.on_example:
                self.recorder.on_example(self.recorder)

    def new_id(self) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        return rid

    def active(self) -> list[str]:
        return self.session.active() if self.session is not None else []

    def busy(self) -> bool:
        return bool(self.active())

    def prefix_len(self, anchor: str, blocks: int, end: str) -> int:
        """Tokens the prefill side transfers: ``blocks`` of the anchor worker's
        block size, then on / one before / one after that boundary, or mid-block."""
        B = self.block[anchor]
        offset = {"on": 0, "before": -1, "after": 1, "mid": min(self.block.values()) // 2}[end]
        return max(1, blocks * B + offset)

    def shared_len(self, share: str, prompt_len: int) -> int:
        Bp, small = self.block[PREFILL], min(self.block.values())
        return {"none": 0, "whole": prompt_len, "one-block": Bp, "two-blocks": 2 * Bp,
                "mid-block": Bp + small // 2}[share]

    # -- rules ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.active()) < self.max_active)
    @rule(anchor=st.sampled_from((PREFILL, DECODE)), blocks=st.integers(1, 2),
          end=st.sampled_from(SUBMIT_ENDS), share=st.sampled_from(SHARES), max_new=st.integers(1, 4))
    def submit(self, anchor, blocks, end, share, max_new):
        """A prompt whose transferred prefix ends on, beside or inside a block of
        either worker, maybe sharing a prefix with earlier prompts."""
        self.open()
        n = self.prefix_len(anchor, blocks, end) + 1
        self.apply(dops.DisaggSubmit(self.new_id(), n, self.shared_len(share, n), max_new))

    @precondition(lambda self: not self.active() and self.overlaps < MAX_OVERLAPS and self.max_active >= 2)
    @rule(blocks=st.integers(1, 2), end=st.sampled_from(ENDS), share=st.sampled_from(SHARES),
          lag=st.integers(2, 3))
    def overlap(self, blocks, end, share, lag):
        """Two requests staggered so the second one's transfer is in flight while
        the first decodes on the decode side's (reused) pages: A ends relative to
        a prefill block, B to a decode block, both sharing the common prefix as
        ``share`` says (B hits what A's prefill cached).  The reference takes 2-3
        steps from submission to its first decode step; another implementation's
        timing may differ, which only changes how often the situation occurs."""
        self.open()
        self.overlaps += 1
        a = self.prefix_len(PREFILL, blocks, end) + 1
        self.apply(dops.DisaggSubmit(self.new_id(), a, self.shared_len(share, a), 3))
        self.apply(dops.DisaggStep(lag))
        b = self.prefix_len(DECODE, blocks, end) + 1
        self.apply(dops.DisaggSubmit(self.new_id(), b, self.shared_len(share, b), 2))
        self.apply(dops.DisaggStep(2))

    @precondition(lambda self: self.busy())
    @rule(count=st.integers(1, 2))
    def step(self, count):
        """Engine steps one at a time: a transfer's chunks post one per step, so
        it stays in flight while other requests prefill and decode."""
        self.apply(dops.DisaggStep(count))

    @precondition(lambda self: self.busy())
    @rule()
    def drain(self):
        self.apply(dops.DisaggDrain())

    @precondition(lambda self: self.busy())
    @rule(which=st.integers(0, 7), mid_transfer=st.booleans())
    def abort(self, which, mid_transfer):
        """The client goes away; ``mid_transfer``: one whose bytes are still landing
        on the decode side, when there is one."""
        pick = (mid_transfer and self.session.in_flight_requests()) or self.session.active()
        self.apply(dops.DisaggAbort(pick[which % len(pick)]))

    @precondition(lambda self: self.busy() and bool(self.faults))
    @rule(which=st.integers(0, len(dops.ARMABLE) - 1))
    def choose_fault(self, which):
        """Which fault ``arm_fault`` arms next (no operation of its own)."""
        self.next_fault = self.faults[which % len(self.faults)]

    @precondition(lambda self: self.busy() and bool(self.faults) and self.arms < MAX_ARMS
                  and (self.armed_at is None or self.session.transfers_submitted > self.armed_at))
    @rule()
    def arm_fault(self):
        """The environment fails the next transfer (one armed fault at a time).
        No arguments, so Hypothesis orders it before ``drain`` and its simplest
        example arms one (the first of ``faults``): a bug that only shows when a
        transfer fails is within reach of every seed's first example."""
        self.arms += 1
        self.armed_at = self.session.transfers_submitted
        self.apply(dops.DisaggArmFault(self.next_fault or self.faults[0]))

    @invariant()
    def harness_bookkeeping_is_sane(self):
        """The harness's own record never runs ahead of itself."""
        if self.session is None:
            return
        for rid, t in self.session.tracks.items():
            assert t.generated <= t.max_new, f"{rid}: generated {t.generated} of {t.max_new}"
