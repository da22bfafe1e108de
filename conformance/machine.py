"""The state machine: Hypothesis drives an implementation through prompts
from shared-prefix bundles, multi-turn replays, chunked prefill, decode,
aborts and memory pressure, checking logits and invariants after every step.

It is importable: an adapter author runs it under their own pytest with

    from conformance.machine import machine_test
    test_my_cache = machine_test(MyCache)

Rules only turn Hypothesis draws into operations (:mod:`conformance.ops`); the
session applies them.  A failing example is recorded as its operation list, so
the minimized failure is data that replays without Hypothesis.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, initialize, precondition, rule

from . import scenarios
from .checks import CheckSpec
from .contract import ImplConfig
from .guard import ImplementationError
from .model import TinyHybrid
from .ops import Abort, Drain, Op, Step, Submit, op_to_dict
from .retention import OBSERVERS
from .oracle import Oracle
from .session import COUNTERS, ConformanceFailure, make_session


@dataclass
class Recorder:
    """What the runs of one check produced: counts, coverage, the last failure."""

    examples: int = 0
    steps: int = 0
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    failure: tuple | None = None  # (exception, ops as data, events)
    on_example: object = None  # progress callback(recorder)
    started: float = field(default_factory=time.perf_counter)
    # When the first failing example appeared (before shrinking): detection cost.
    first_failure: tuple[int, float] | None = None  # (examples run, seconds)


def build_machine(impl_factory, spec: CheckSpec, model: TinyHybrid, oracle: Oracle, recorder: Recorder,
                  impl_config: ImplConfig, timeout: float | None = 30.0, wrap=None) -> type:
    """A RuleBasedStateMachine class bound to one implementation and check."""
    B = impl_config.block_size
    vocab = model.config.vocab_size
    max_blocks = spec.max_prompt_blocks
    max_len = spec.max_seq_blocks * B
    enabled = spec.rules

    class HybridCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.session = None
            self.ops: list[Op] = []
            self.next_id = 0
            self.finished: list[str] = []
            recorder.examples += 1

        @initialize(bases=scenarios.shared_prefixes(vocab, B, max_blocks))
        def start(self, bases):
            self.bases = bases
            impl = impl_factory
            self.session = make_session(impl, impl_config, model, oracle, timeout=timeout)
            if wrap is not None:
                wrap(self.session)
            for name in spec.observe:  # checks run after every step (conformance/retention.py)
                self.session.observers.append(OBSERVERS[name](self.session))

        # -- plumbing ------------------------------------------------------------
        def apply(self, op: Op) -> None:
            note(repr(op))
            self.ops.append(op)
            recorder.steps += 1
            try:
                self.session.apply(op)
            except (ConformanceFailure, ImplementationError) as exc:
                recorder.failure = (exc, [op_to_dict(o) for o in self.ops], list(self.session.history.events))
                if recorder.first_failure is None:
                    recorder.first_failure = (recorder.examples, round(time.perf_counter() - recorder.started, 3))
                raise
            self.finished = [rid for rid, t in self.session.tracks.items() if t.done and t.generated > 0]

        def teardown(self):
            if self.session is not None:
                for k, v in self.session.coverage.items():
                    recorder.coverage[k] = recorder.coverage.get(k, 0) + v
            if recorder.on_example:
                recorder.on_example(recorder)

        def fits(self, length: int, max_new: int) -> bool:
            """Keep concurrency within the layout so a correct cache never stalls."""
            active = [self.session.tracks[r] for r in self.session.active()]
            if len(active) >= spec.max_active or length + max_new > max_len:
                return False
            need = sum(-(-(t.prompt_len + t.max_new) // B) + 1 for t in active) + -(-(length + max_new) // B) + 1
            return need <= impl_config.num_kv_blocks and 2 * (len(active) + 1) <= impl_config.num_state_slots

        def new_id(self) -> str:
            self.next_id += 1
            return f"r{self.next_id}"

        # -- rules ---------------------------------------------------------------
        @rule(base=st.integers(0, 2), cut=scenarios.boundary_lengths(B, max_blocks),
              suffix_len=st.sampled_from([0, 0, 1, B - 1, B + 1]), suffix=scenarios.tokens(vocab, B + 1),
              max_new=st.integers(1, spec.max_new_tokens))
        def submit(self, base, cut, suffix_len, suffix, max_new):
            prompt = self.bases[base][:cut] + suffix[:suffix_len]
            if self.fits(len(prompt), max_new):
                self.apply(Submit(self.new_id(), prompt, max_new))

        @precondition(lambda self: "continue" in enabled and self.finished)
        @rule(which=st.integers(0, 7), suffix_len=st.sampled_from([1, 2, B - 1, B, B + 1]),
              suffix=scenarios.tokens(vocab, B + 1), max_new=st.integers(1, spec.max_new_tokens))
        def continue_turn(self, which, suffix_len, suffix, max_new):
            prev = self.finished[which % len(self.finished)]
            prompt = self.session.tracks[prev].tokens + suffix[:suffix_len]
            if self.fits(len(prompt), max_new):
                self.apply(Submit(self.new_id(), prompt, max_new, continues=prev))

        @precondition(lambda self: self.session is not None and self.session.tracks)
        @rule(which=st.integers(0, 7), cut=scenarios.boundary_lengths(B, max_blocks),
              suffix_len=st.sampled_from([1, 2, B - 1, B + 1]), suffix=scenarios.tokens(vocab, B + 1),
              max_new=st.integers(1, spec.max_new_tokens))
        def share(self, which, cut, suffix_len, suffix, max_new):
            """A prompt that shares a boundary-relative prefix with any earlier
            request (finished, running or aborted): where snapshots get reused."""
            rids = list(self.session.tracks)
            prompt = self.session.tracks[rids[which % len(rids)]].tokens[:cut] + suffix[:suffix_len]
            if self.fits(len(prompt), max_new):
                self.apply(Submit(self.new_id(), prompt, max_new))

        @precondition(lambda self: "step" in enabled and self.session is not None and self.session.active())
        @rule(budget=scenarios.budgets(B))
        def step(self, budget):
            self.apply(Step(budget))

        @precondition(lambda self: self.session is not None and self.session.active())
        @rule(budget=scenarios.budgets(B) if "step" in enabled else st.just(1024))
        def drain(self, budget):
            self.apply(Drain(budget))

        @precondition(lambda self: "abort" in enabled and self.session is not None and self.session.active())
        @rule(which=st.integers(0, 7))
        def abort(self, which):
            active = self.session.active()
            self.apply(Abort(active[which % len(active)]))

        @precondition(lambda self: "pressure" in enabled and self.session is not None
                      and not self.session.active())
        # Junk long enough that one round turns over most of the pool: shorter
        # prompts only take never-used blocks and never evict anything reused.
        @rule(junk=st.lists(scenarios.tokens(vocab, max(4 * B, min(max_len, impl_config.num_kv_blocks // 3 * B) - 1)),
                            min_size=2, max_size=3))
        def pressure(self, junk):
            """Distinct long prompts, run to completion: cached entries must be evicted."""
            for prompt in junk:
                self.apply(Submit(self.new_id(), prompt, 1))
                self.apply(Drain(1024))

    HybridCacheMachine.__name__ = f"HybridCacheMachine[{spec.id}]"
    return HybridCacheMachine


@contextmanager
def stable_draws():
    """Make one seed give the same examples in every process.

    Hypothesis (6.13x and later) mixes constants collected from whatever local
    modules happen to be imported into its draws, so the CLI, a --workers
    process and a pytest session would explore differently from one seed.
    While our checks run, it draws from no local constants at all."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # an older Hypothesis without the mechanism
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    if original is None:
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original


def hypothesis_settings(spec: CheckSpec, examples: int, steps: int, database=None, shrink: bool = True) -> settings:
    # shrink=False: the caller minimizes the failing operations itself (conformance/minimize.py)
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p is not Phase.shrink)
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=database, phases=phases,
                    derandomize=False, report_multiple_bugs=False, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def machine_test(impl_factory, check: str = "mixed", examples: int = 50, steps: int = 20,
                 impl_config: ImplConfig | None = None, model_config=None):
    """A pytest-collectable test running one check's machine against ``impl_factory``."""
    from .checks import get_check
    from .model import ModelConfig

    spec = get_check(check)
    model = TinyHybrid(model_config or ModelConfig())
    machine = build_machine(impl_factory, spec, model, Oracle(model), Recorder(),
                            impl_config or spec.impl_config(), timeout=None)
    test = get_state_machine_test(machine, settings=hypothesis_settings(spec, examples, steps))
    name = f"test_conformance_{spec.id.replace('-', '_')}"

    def run_test():
        with stable_draws():
            test()

    run_test.__name__ = name
    return run_test
