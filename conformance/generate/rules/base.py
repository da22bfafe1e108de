"""The machine's plumbing, shared by every rule group (:class:`MachineBase`):
it builds the session, applies each operation the rules make (recording it,
and the failure it raises), applies the pool probe after an example, and
leaves the example's coverage and notes in the recorder."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import note
from hypothesis.stateful import RuleBasedStateMachine, invariant

from conformance.contract import ImplConfig
from conformance.errors import Abandoned, ConformanceFailure, ImplementationError
from conformance.generate import strategies
from conformance.generate.budget import blocks_for, slots_for
from conformance.generate.configured import Conf, ExampleStopped, configured_rule
from conformance.generate.probe_sizing import pool_probe
from conformance.generate.recorder import Recorder
from conformance.generate.spec import CheckSpec, mixed
from conformance.harness.ops import HoldTransfers, Op, op_to_dict
from conformance.harness.oracle import Oracle
from conformance.harness.session import Session, make_session
from conformance.judge import standard_checkers
from conformance.judge.invariants import NO_KV_REFCOUNTS, NO_STATE_REFCOUNTS
from conformance.model import ModelConfig, TinyHybrid

# The pool probe's sampling (see MachineBase._probe_due).
PROBE_EVERY = 20


class MachineBase(RuleBasedStateMachine):
    """Plumbing shared by the rule groups: the session, the operations applied,
    the pool probe after an example, what the example leaves in the recorder.

    The rule groups are its subclasses; :class:`~conformance.generate.machine.HybridCacheMachine`
    composes them and binds their rules to a configuration
    (:mod:`conformance.generate.configured`)."""

    session: Session
    conf: Conf | None = None  # set on the bound subclasses

    def __init__(self, impl_factory, spec: CheckSpec | None = None, *, model: TinyHybrid | None = None,
                 oracle: Oracle | None = None, impl_config: ImplConfig | None = None,
                 timeout: float | None = 30.0, recorder: Recorder | None = None,
                 attach: Callable[[Session], None] | None = None, probe: bool = True,
                 known: Callable[[Exception], Any] | None = None):
        super().__init__()
        self.impl_factory = impl_factory
        self.spec = spec or mixed()
        self.model = model or TinyHybrid(ModelConfig())
        self.oracle = oracle or Oracle(self.model)
        self.impl_config = impl_config or self.spec.impl_config()
        if self.model.config.window_groups and not self.impl_config.layer_kinds:  # the cache is told its windows
            self.impl_config = replace(self.impl_config, **self.model.config.window_facts())
        self.timeout = timeout
        self.recorder = recorder or Recorder()
        # Called with each new session: more checkers (metrics), environment faults.
        self.attach = attach
        # The pool probe after each example (generate/probe_sizing.py): black-box leak detection.
        self.probe = probe
        # Classifies a failure as a known defect of the engine version (or None:
        # NEW).  A known one ends the example quietly (``stopped``): recorded,
        # not raised, so Hypothesis counts the example valid, never shrinks
        # towards it, and goes on exploring with the rest of the budget
        # (conformance/suite/known.py).
        self.known = known
        self.stopped = False
        self.failed = False
        self.B = self.impl_config.block_size
        self.max_len = self.spec.max_seq_blocks * self.B
        self.session = None  # type: ignore[assignment]
        self.ops: list[Op] = []
        self.next_id = 0
        self.finished: list[str] = []
        self.built: set[str] = set()  # histories a once-an-example rule built in this example
        self.recorder.examples += 1

    def enabled(self, rule_group: str) -> bool:
        return rule_group in self.spec.rules

    @configured_rule(first=True, bases=lambda c: strategies.shared_prefixes(c.vocab, c.B, c.spec.max_prompt_blocks))
    def start(self, bases):
        self.bases = bases
        try:
            self.session = make_session(self.impl_factory, self.impl_config, self.model, self.oracle,
                                        standard_checkers(self.spec.observers), timeout=self.timeout)
        except ImplementationError as exc:
            self._found(exc)
            raise
        if self.attach is not None:
            self.attach(self.session)
        if self.enabled("transfers"):  # the wire's timing becomes the generator's (Transfers below)
            self.apply(HoldTransfers())

    def apply(self, op: Op) -> None:
        if self.stopped:
            # A known defect ended this example: the session may be corrupt (a
            # step raised half-way), so nothing more is applied, and the rule
            # that called ends here (configured.ExampleStopped).  The remaining
            # rules still draw, so the example's choices stay what they were.
            raise ExampleStopped
        note(repr(op))
        self.ops.append(op)
        self.recorder.steps += 1
        try:
            self.session.apply(op)
        except (ConformanceFailure, ImplementationError) as exc:
            if self._absorb_known(exc):
                raise ExampleStopped from None
            self._found(exc)
            raise
        self.finished = [rid for rid, t in self.session.tracks.items() if t.done and t.generated > 0]

    def _absorb_known(self, exc: Exception) -> bool:
        defect = self.known(exc) if self.known is not None else None
        if defect is None:
            return False
        self.stopped = True
        self.recorder.met(defect, exc, [op_to_dict(o) for o in self.ops], self.session.history.tail(64))
        note(f"known defect {defect.id} met; the example ends here: {exc}")
        return True

    def _found(self, exc: ConformanceFailure | ImplementationError) -> None:
        """Record a finding; a hang abandons the check at once (:class:`Abandoned`:
        no replay of the example, no later call of the implementation)."""
        self.failed = True
        rec = self.recorder
        rec.failure = (exc, [op_to_dict(o) for o in self.ops],
                       self.session.history.tail(64) if self.session is not None else [])
        if rec.first_failure is None:
            rec.first_failure = (rec.examples, round(time.perf_counter() - rec.started, 3))
        if isinstance(exc, ImplementationError) and exc.kind == "timeout":
            raise Abandoned(exc) from None

    def teardown(self):
        try:
            if self.session is not None and self.probe and not self.failed and not self.stopped \
                    and self._probe_due():
                # At idle the cache must still serve what a fresh instance serves:
                # a leaked block or slot fails here, whatever its view says.
                try:
                    probe = pool_probe(self.impl_factory, self.impl_config, self.model, self.oracle, self.timeout)
                except ImplementationError as exc:  # a fresh instance hung while it was measured
                    self._found(exc)
                    raise
                if probe is not None:
                    try:
                        self.apply(probe)
                    except ExampleStopped:  # the probe met a known defect (recorded)
                        pass
        finally:
            if self.session is not None:
                for k, v in self.session.coverage.items():
                    self.recorder.coverage[k] = self.recorder.coverage.get(k, 0) + v
                self.recorder.notes |= self.session.notes
            if self.recorder.on_example:
                self.recorder.on_example(self.recorder)

    def _probe_due(self) -> bool:
        """The pool probe costs about one engine step per KV block: it runs
        after one example in PROBE_EVERY, and after every example whose views
        stated no refcounts (nothing else can show a leak then).  Which
        examples is decided by their operations, never by a count: Hypothesis
        replays a failing example and must see it fail again."""
        if any(note in self.session.notes for note in (NO_KV_REFCOUNTS, NO_STATE_REFCOUNTS)):
            return True
        return zlib.crc32(repr(self.ops).encode()) % PROBE_EVERY == 0

    def fits(self, length: int, max_new: int) -> bool:
        """Keep concurrency within the layout so a correct cache never stalls
        (``ceil((prompt + new) / B) + 1`` blocks a request, for the full
        layers and again for each window group)."""
        B, cfg = self.B, self.impl_config
        active = [self.session.tracks[r] for r in self.session.active()]
        if len(active) >= self.spec.max_active or length + max_new > self.max_len:
            return False
        need = sum(blocks_for(t.prompt_len, t.max_new, B) for t in active) + blocks_for(length, max_new, B)
        # sliding windows: each window group may hold as many blocks again (a prefill chunk
        # allocates its window layers' blocks for every position it computes, as vLLM does)
        # (the groups memory holds: the model's windows, or the cache's own layer groups, Layout)
        need *= 1 + len(self.session.memory.windows)
        # speculative decoding: a state slot per draft a request may verify, besides its two
        declared = self.session.speculator.declared
        slots = slots_for(declared.max_drafts if declared is not None else 0)
        return need <= cfg.num_kv_blocks and slots * (len(active) + 1) <= cfg.num_state_slots

    def longest_alone(self, max_new: int = 1) -> int:
        """The longest prompt :meth:`fits` admits with nothing else active
        (the pool, not the check, bounds the junk that displaces entries)."""
        B, groups = self.B, 1 + len(self.session.memory.windows)  # as fits() counts them
        return max(0, min(self.max_len - max_new, (self.impl_config.num_kv_blocks // groups - 1) * B - max_new))

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def busy(self) -> bool:
        return self.session is not None and bool(self.session.active())

    @invariant()
    def harness_bookkeeping_is_sane(self):
        """The harness's own record never runs ahead of itself (a harness bug
        here would make every other verdict meaningless)."""
        if self.session is None or self.stopped:
            return
        for rid, t in self.session.tracks.items():
            assert t.generated <= t.max_new, f"{rid}: generated {t.generated} of {t.max_new}"
            assert t.computed is None or t.computed <= len(t.tokens), f"{rid}: computed past its tokens"
