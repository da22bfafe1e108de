"""The state machine: Hypothesis drives an implementation through prompts
from shared-prefix bundles, multi-turn replays, chunked prefill, decode,
aborts and memory pressure; the session's checkers judge every step.

One exported class that takes the implementation under test in its
constructor (as zarr's ``ZarrHierarchyStateMachine(store)`` does)::

    from hypothesis.stateful import run_state_machine_as_test
    from conformance.generate.machine import HybridCacheMachine

    run_state_machine_as_test(lambda: HybridCacheMachine(MyCache))

or, as a pytest test with the check's coverage enforced,
:func:`conformance.testing.machine_test`.

Rule groups are mixins (:class:`Prompts`, :class:`Steps`, :class:`Aborts`,
:class:`Pressure`); a check's ``CheckSpec.rules`` enables the optional ones.
Rules only turn Hypothesis draws into operations
(:mod:`conformance.harness.ops`); the session applies them, so a failing
example is recorded as its operation list: data that replays without
Hypothesis.  Draws that depend on the configuration (block size, vocabulary)
are made with ``st.data()`` inside the rule, so the class needs no
configuration to be defined.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conformance.contract import ImplConfig
from conformance.errors import Abandoned, ConformanceFailure, ImplementationError
from conformance.generate import strategies
from conformance.generate.probe import pool_probe
from conformance.generate.spec import CheckSpec, mixed
from conformance.harness.ops import (
    OUTCOMES,
    Abort,
    Deliver,
    Drain,
    HoldTransfers,
    Op,
    Step,
    StoreEvict,
    Submit,
    op_to_dict,
)
from conformance.harness.oracle import Oracle
from conformance.harness.session import Session, make_session
from conformance.judge import standard_checkers
from conformance.judge.coverage import COUNTERS
from conformance.judge.invariants import NO_KV_REFCOUNTS, NO_STATE_REFCOUNTS
from conformance.model import ModelConfig, TinyHybrid

# The pool probe's sampling (see _Base._probe_due).
PROBE_EVERY = 20


@dataclass
class Recorder:
    """What the runs of one check produced: counts, coverage, the last failure."""

    examples: int = 0
    steps: int = 0
    coverage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    failure: tuple | None = None  # (exception, ops as data, events)
    notes: set[str] = field(default_factory=set)  # reduced assurance the checkers reported
    on_example: Callable[[Recorder], None] | None = None  # progress callback
    started: float = field(default_factory=time.perf_counter)
    # When the first failing example appeared (before shrinking): detection cost.
    first_failure: tuple[int, float] | None = None  # (examples run, seconds)


@dataclass(frozen=True)
class Conf:
    """What the rules' strategies depend on: the check, the block size, the vocabulary."""

    spec: CheckSpec
    B: int
    vocab: int
    num_kv_blocks: int

    @property
    def max_len(self) -> int:
        return self.spec.max_seq_blocks * self.B


def configured_rule(precondition: Callable | None = None, first: bool = False,
                    **arguments: Callable[[Conf], st.SearchStrategy]):
    """A rule whose argument strategies depend on the configuration: each
    ``arguments`` value maps a :class:`Conf` to a strategy.  The machine binds
    them when it is built for a configuration, so Hypothesis sees plain rules
    with concrete strategies (draws, shrinking and replay exactly as written).
    ``first``: an ``@initialize`` rule (runs once, before the others)."""

    def deco(fn):
        fn._configured = (precondition, first, arguments)
        return fn

    return deco


class _Base(RuleBasedStateMachine):
    """Plumbing shared by the rule groups: the session, the operations applied.

    ``HybridCacheMachine(impl_factory, spec, ...)`` returns an instance of a
    subclass bound to the configuration (one per configuration, cached): the
    rules' strategies need the block size and vocabulary, and Hypothesis reads
    rules from the class."""

    session: Session
    conf: Conf | None = None  # set on the bound subclasses
    _bound: dict = {}

    def __new__(cls, impl_factory=None, spec: CheckSpec | None = None, *, model: TinyHybrid | None = None,
                impl_config: ImplConfig | None = None, **_):
        if cls.conf is not None:
            return super().__new__(cls)
        spec = spec or mixed()
        impl_config = impl_config or spec.impl_config()
        vocab = (model.config if model is not None else ModelConfig()).vocab_size
        conf = Conf(spec, impl_config.block_size, vocab, impl_config.num_kv_blocks)
        return super().__new__(cls.bound(conf))

    @classmethod
    def bound(cls, conf: Conf) -> type:
        """The subclass of ``cls`` whose rules draw for ``conf``."""
        key = (cls, repr(conf))  # a CheckSpec holds a dict: not hashable, but its repr is exact
        if key not in _Base._bound:
            attrs: dict = {"conf": conf}
            mixins = tuple(m for m, names in OPTIONAL_GROUPS if names & conf.spec.rules and not issubclass(cls, m))
            composite = type(cls.__name__, (cls, *mixins), {}) if mixins else cls
            for klass in reversed(composite.__mro__):
                for name, fn in vars(klass).items():
                    if hasattr(fn, "_configured"):
                        pre, first, arguments = fn._configured
                        decorate = initialize if first else rule
                        bound = decorate(**{k: make(conf) for k, make in arguments.items()})(fn)
                        attrs[name] = precondition(pre)(bound) if pre is not None else bound
            sub = type(f"{cls.__name__}[{conf.spec.id}]", (composite,), attrs)
            _Base._bound[key] = sub
        return _Base._bound[key]

    def __init__(self, impl_factory, spec: CheckSpec | None = None, *, model: TinyHybrid | None = None,
                 oracle: Oracle | None = None, impl_config: ImplConfig | None = None,
                 timeout: float | None = 30.0, recorder: Recorder | None = None,
                 attach: Callable[[Session], None] | None = None, probe: bool = True):
        super().__init__()
        self.impl_factory = impl_factory
        self.spec = spec or mixed()
        self.model = model or TinyHybrid(ModelConfig())
        self.oracle = oracle or Oracle(self.model)
        self.impl_config = impl_config or self.spec.impl_config()
        self.timeout = timeout
        self.recorder = recorder or Recorder()
        # Called with each new session: more checkers (metrics), environment faults.
        self.attach = attach
        # The pool probe after each example (generate/probe.py): black-box leak detection.
        self.probe = probe
        self.failed = False
        self.B = self.impl_config.block_size
        self.max_len = self.spec.max_seq_blocks * self.B
        self.session = None  # type: ignore[assignment]
        self.ops: list[Op] = []
        self.next_id = 0
        self.finished: list[str] = []
        self.recorder.examples += 1

    def enabled(self, rule_group: str) -> bool:
        return rule_group in self.spec.rules

    @configured_rule(first=True, bases=lambda c: strategies.shared_prefixes(c.vocab, c.B, c.spec.max_prompt_blocks))
    def start(self, bases):
        self.bases = bases
        try:
            self.session = make_session(self.impl_factory, self.impl_config, self.model, self.oracle,
                                        standard_checkers(self.spec.observe), timeout=self.timeout)
        except ImplementationError as exc:
            self._found(exc)
            raise
        if self.attach is not None:
            self.attach(self.session)
        if self.enabled("transfers"):  # the wire's timing becomes the generator's (Transfers below)
            self.apply(HoldTransfers())

    def apply(self, op: Op) -> None:
        note(repr(op))
        self.ops.append(op)
        self.recorder.steps += 1
        try:
            self.session.apply(op)
        except (ConformanceFailure, ImplementationError) as exc:
            self._found(exc)
            raise
        self.finished = [rid for rid, t in self.session.tracks.items() if t.done and t.generated > 0]

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
            if self.session is not None and self.probe and not self.failed and self._probe_due():
                # At idle the cache must still serve what a fresh instance serves:
                # a leaked block or slot fails here, whatever its view says.
                try:
                    probe = pool_probe(self.impl_factory, self.impl_config, self.model, self.oracle, self.timeout)
                except ImplementationError as exc:  # a fresh instance hung while it was measured
                    self._found(exc)
                    raise
                if probe is not None:
                    self.apply(probe)
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
        """Keep concurrency within the layout so a correct cache never stalls."""
        B, cfg = self.B, self.impl_config
        active = [self.session.tracks[r] for r in self.session.active()]
        if len(active) >= self.spec.max_active or length + max_new > self.max_len:
            return False
        need = sum(-(-(t.prompt_len + t.max_new) // B) + 1 for t in active) + -(-(length + max_new) // B) + 1
        return need <= cfg.num_kv_blocks and 2 * (len(active) + 1) <= cfg.num_state_slots

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def busy(self) -> bool:
        return self.session is not None and bool(self.session.active())

    @invariant()
    def harness_bookkeeping_is_sane(self):
        """The harness's own record never runs ahead of itself (a harness bug
        here would make every other verdict meaningless)."""
        if self.session is None:
            return
        for rid, t in self.session.tracks.items():
            assert t.generated <= t.max_new, f"{rid}: generated {t.generated} of {t.max_new}"
            assert t.computed is None or t.computed <= len(t.tokens), f"{rid}: computed past its tokens"


def _suffix(lengths):
    return dict(suffix_len=lambda c: st.sampled_from(lengths(c.B)),
                suffix=lambda c: strategies.tokens(c.vocab, c.B + 1),
                max_new=lambda c: st.integers(1, c.spec.max_new_tokens))


class Prompts(_Base):
    """New prompts: cut from the shared bases at block-relative lengths, shared
    with any earlier request, or continuing a finished one (multi-turn)."""

    def _submit(self, prompt, max_new, continues=None):
        if self.fits(len(prompt), max_new):
            self.apply(Submit(self.new_id(), prompt, max_new, continues=continues))

    @configured_rule(base=lambda c: st.integers(0, 2),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     **_suffix(lambda B: [0, 0, 1, B - 1, B + 1]))
    def submit(self, base, cut, suffix_len, suffix, max_new):
        self._submit(self.bases[base][:cut] + suffix[:suffix_len], max_new)

    @configured_rule(precondition=lambda self: self.enabled("continue") and self.finished,
                     which=lambda c: st.integers(0, 7), **_suffix(lambda B: [1, 2, B - 1, B, B + 1]))
    def continue_turn(self, which, suffix_len, suffix, max_new):
        prev = self.finished[which % len(self.finished)]
        self._submit(self.session.tracks[prev].tokens + suffix[:suffix_len], max_new, continues=prev)

    @configured_rule(precondition=lambda self: self.session is not None and self.session.tracks,
                     which=lambda c: st.integers(0, 7),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     **_suffix(lambda B: [1, 2, B - 1, B + 1]))
    def share(self, which, cut, suffix_len, suffix, max_new):
        """A prompt that shares a boundary-relative prefix with any earlier
        request (finished, running or aborted): where snapshots get reused."""
        rids = list(self.session.tracks)
        self._submit(self.session.tracks[rids[which % len(rids)]].tokens[:cut] + suffix[:suffix_len], max_new)


class Steps(_Base):
    """Engine steps: one at a time under a token budget (chunked prefill,
    decode interleaved), or draining everything."""

    @configured_rule(precondition=lambda self: self.enabled("step") and self.busy(),
                     budget=lambda c: strategies.budgets(c.B))
    def step(self, budget):
        self.apply(Step(budget))

    @configured_rule(precondition=lambda self: self.busy(),
                     budget=lambda c: strategies.budgets(c.B) if "step" in c.spec.rules else st.just(1024))
    def drain(self, budget):
        self.apply(Drain(budget))


class Aborts(_Base):
    """The client goes away."""

    @configured_rule(precondition=lambda self: self.enabled("abort") and self.busy(),
                     which=lambda c: st.integers(0, 7))
    def abort(self, which):
        active = self.session.active()
        self.apply(Abort(active[which % len(active)]))


def _junk(c: Conf) -> st.SearchStrategy:
    # Junk long enough that one round turns over most of the pool: shorter
    # prompts only take never-used blocks and never evict anything reused.
    length = max(4 * c.B, min(c.max_len, c.num_kv_blocks // 3 * c.B) - 1)
    return st.lists(strategies.tokens(c.vocab, length), min_size=2, max_size=3)


class Pressure(_Base):
    """Memory pressure: distinct long prompts, run to completion, so cached
    entries must be evicted."""

    @configured_rule(precondition=lambda self: self.enabled("pressure") and self.session is not None
                     and not self.session.active(), junk=_junk, which=lambda c: st.integers(0, 7),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     suffix=lambda c: strategies.tokens(c.vocab, 1))
    def pressure(self, junk, which, cut, suffix):
        before = list(self.session.tracks)
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        # Reuse right after the pool turned over: a prefix of a request from
        # before (evicted: a miss, or a load from a second tier), then one of
        # the latest junk (what an LRU cache still holds), so that a hit after
        # an eviction -- what eviction-pressure requires -- occurs every time.
        earlier = [self.session.tracks[before[which % len(before)]].tokens] if before else []
        for seq in (*earlier, junk[-1]):
            again = seq[: min(cut, len(seq) - 1)] + suffix
            if self.fits(len(again), 1):
                self.apply(Submit(self.new_id(), again, 1))
                self.apply(Drain(1024))


_DIVERGING = dict(which=lambda c: st.integers(0, 7), k=lambda c: st.integers(0, c.spec.max_prompt_blocks),
                  offset=lambda c: st.integers(0, c.B - 1), tail=lambda c: st.booleans(),
                  rest=lambda c: strategies.tokens(c.vocab, c.B),
                  max_new=lambda c: st.integers(1, c.spec.max_new_tokens))


class HardHistories(_Base):
    """The histories a uniform draw almost never reaches (issue 14): pressure
    while requests are mid-prefill and mid-decode, several cold prefills of
    one prefix in one step, a prefix cached, displaced and requested again,
    prompts that diverge from a cached one at every offset inside a block,
    and aborts of requests that are running.  Each group has its own name in
    ``CheckSpec.rules``; their coverage is counted by
    :class:`conformance.judge.hard_coverage.HardHistoryCoverage`."""

    @configured_rule(precondition=lambda self: self.enabled("live-pressure") and self.busy(),
                     prompt=lambda c: strategies.tokens(c.vocab, max(2 * c.B, min(c.max_len, c.num_kv_blocks // 2
                                                                                   * c.B) - 1)),
                     cut=lambda c: st.integers(2, 4), budget=lambda c: strategies.budgets(c.B))
    def pressure_while_running(self, prompt, cut, budget):
        """A long distinct prompt arrives while others run, and a step runs at
        once: its allocations evict while the others are mid-prefill or
        mid-decode (and, with a request waiting on a hit, between its match
        and its use).

        Until the cache evicts, another distinct prompt (the drawn one with
        every token shifted) arrives with the next step, as many as the KV
        pool the implementation reports could hold, plus one.  One prompt
        turns over a pool only where the pool is small next to it (the
        reference's 10 state slots, a snapshot per block); where one pool of
        blocks holds KV and the few states a cache keeps, and never-used
        blocks go first (vLLM: ``BlockPool.free_blocks`` queues unhashed
        blocks ahead of cached ones), nothing is evicted before about a
        pool's worth of distinct blocks was computed, which one example's
        prompts of at most ``max_seq_blocks`` rarely reach (vLLM, 28 blocks:
        2 evictions while running in pressure-while-running's quick run,
        against the reference's 141).  Once the pool is warm, the first
        prompt evicts and the rule ends there."""
        prompt = prompt[: max(2 * self.B, len(prompt) * cut // 4)]
        evicted = self.session.coverage.get("evictions", 0)
        rounds = min(self.vocab, self.session.layout.num_kv_blocks // -(-len(prompt) // self.B) + 1)
        for i in range(rounds):
            if i and (self.session.coverage.get("evictions", 0) > evicted or not self.busy()):
                break
            distinct = tuple((t + i) % self.vocab for t in prompt)  # i = 0: the drawn prompt
            if self.fits(len(distinct), 1):
                self.apply(Submit(self.new_id(), distinct, 1))
            self.apply(Step(budget))

    @configured_rule(precondition=lambda self: self.enabled("burst") and self.session is not None,
                     base=lambda c: st.integers(0, 2),
                     cut=lambda c: strategies.boundary_lengths(c.B, c.spec.max_prompt_blocks),
                     copies=lambda c: st.integers(2, 3), suffix=lambda c: strategies.tokens(c.vocab, c.B + 1),
                     ends=lambda c: st.lists(st.integers(0, c.B + 1), min_size=3, max_size=3))
    def same_prefix_burst(self, base, cut, copies, suffix, ends):
        """Several requests with one cold prefix, scheduled in one step: each
        reaches the same checkpoints at the same time.  The copies repeat or
        extend one another, or (``apart``: the last length drawn is odd) each
        continues past the prefix with a token of its own and at least a block
        more, so that the state it caches at its prompt's end (or the block
        boundary before it) lies past the shared prefix: a cache that will not
        start a request on a state another request caches in the same step
        (vLLM's MambaManager.get_num_blocks_to_allocate defers it to the next
        step) starts only such copies together, cold.  Steps first (at most
        eight) until two more requests have room: with every request slot
        taken no copy fit, and the burst was a bare step.  ``apart`` comes from
        a draw the rule already made, so the checks keep their choice sequences."""
        prefix = self.bases[base][:cut] + suffix
        apart = ends[-1] % 2 == 1
        for _ in range(8):
            if len(self.session.active()) + 2 <= self.spec.max_active:
                break
            self.apply(Step(1024))
        for i, n in enumerate(ends[:copies]):
            # two tokens each: after the step the copies are mid-decode, so what
            # their allocations evicted was evicted while requests ran
            if apart:
                self._submit_if_fits(prefix + ((suffix[-1] + 1 + i) % self.vocab,) + suffix[:max(n, self.B)], 2)
            else:
                self._submit_if_fits(prefix + suffix[:n], 2)
        self.apply(Step(1024))

    @configured_rule(precondition=lambda self: self.enabled("aba") and self.session is not None
                     and not self.session.active() and self.finished,
                     which=lambda c: st.integers(0, 7), junk=_junk)
    def displaced_and_requested_again(self, which, junk):
        """A -> B -> A: a finished prompt, displaced by distinct prompts, asked for again."""
        prev = self.session.tracks[self.finished[which % len(self.finished)]]
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        self._submit_if_fits(prev.tokens[: prev.prompt_len], 1)
        if self.enabled("transfers"):
            self.apply(Step(1))  # the tier issues its loads: they are pending for the rules of Transfers

    @configured_rule(precondition=lambda self: self.enabled("diverge") and self.session is not None
                     and self.session.tracks, **_DIVERGING)
    def diverge_inside_a_block(self, which, k, offset, tail, rest, max_new):
        """A prompt that agrees with an earlier sequence up to ``k*B + offset``
        (or up to one token into that sequence's partial tail) and differs at
        the next token: a divergence at every offset inside a block.  One
        draw in three submits the sequence cut there instead (a prompt whose
        hit ends inside a block)."""
        rids = list(self.session.tracks)
        seq = self.session.tracks[rids[which % len(rids)]].tokens
        at = len(seq) // self.B * self.B + 1 if tail and len(seq) % self.B > 1 else k * self.B + offset
        if not 0 < at < len(seq):
            return
        if rest[0] % 3 == 0 and at % self.B:
            # or the cached sequence cut there: a prompt whose hit ends inside a block
            self._submit_if_fits(seq[:at], max_new)
            return
        other = (seq[at] + 1 + rest[0] % (self.vocab - 1)) % self.vocab  # never the cached token
        self._submit_if_fits(seq[:at] + (other,) + rest[1:], max_new)

    @configured_rule(precondition=lambda self: self.enabled("live-abort") and self.busy(),
                     which=lambda c: st.integers(0, 7), decode=lambda c: st.booleans(),
                     budget=lambda c: st.sampled_from(sorted({1, 2, c.B - 1, c.B + 1} - {0})))
    def abort_running(self, which, decode, budget):
        """Abort a request that has run: mid-decode, or mid-prefill (after its
        hit, which the step budget cuts short).  Steps first until it is there.
        Mid-decode only a request that asked for two tokens or more: one that
        asked for one finishes in the step that ends its prefill."""
        tracks = self.session.tracks
        active = [r for r in self.session.active()
                  if (tracks[r].max_new > 1 if decode
                      else tracks[r].computed is None or tracks[r].computed < tracks[r].prompt_len)]
        if not active:
            return
        rid = active[which % len(active)]
        for _ in range(8 if decode else 24):  # small budgets go to the requests ahead of it first
            t = self.session.tracks[rid]
            if t.done:
                return
            there = (t.computed is not None and t.computed >= t.prompt_len if decode
                     else t.computed is not None and t.computed < t.prompt_len)
            if there:
                self.apply(Abort(rid))
                return
            if not decode and t.computed is not None:
                return  # its prefill is over
            # ahead of it, each running request takes at most a block's chunk
            self.apply(Step(1024 if decode else self.B * (len(self.session.active()) - 1) + budget))

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def _submit_if_fits(self, prompt, max_new) -> None:
        if self.fits(len(prompt), max_new):
            self.apply(Submit(self.new_id(), tuple(prompt), max_new))


class Transfers(_Base):
    """The host tier's wire under the generator's control (rule name
    ``transfers``; the check must run with the tier on).  Loads stay pending
    after the step that issued them; while they are pending the generator
    decides their completion (now, later, failed, short, out of order), evicts
    the host entry they are about to read, claims the same prefix with a second
    request, evicts locally, or aborts the request that waits."""

    def _loading(self) -> bool:
        return self.enabled("transfers") and self.session is not None and bool(self.session.pending_loads())

    @configured_rule(precondition=lambda self: self.enabled("transfers") and self.session is not None
                     and self.finished,
                     which=lambda c: st.integers(0, 7), junk=_junk,
                     fates=lambda c: st.lists(st.tuples(st.integers(0, 3),
                                                        st.sampled_from(("short", "fail", "evict", "ok")),
                                                        st.integers(0, 2)), min_size=2, max_size=4))
    def reload_and_decide(self, which, junk, fates):
        """A finished prompt displaced to the host tier and asked for again;
        its loads are decided at once (outcome, delay, order; or the host
        entry evicted after the lookup)."""
        if self.session.active():  # requests are rarely all finished between rules: finish them
            self.apply(Drain(1024))
        # the longer prompts first: only what spans a block can come back from the tier
        longest = sorted(self.finished, key=lambda r: -self.session.tracks[r].prompt_len)
        prev = self.session.tracks[longest[which % min(2, len(longest))]]
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        if self.fits(prev.prompt_len, 1):
            self.apply(Submit(self.new_id(), prev.tokens[: prev.prompt_len], 1))
            self.apply(Step(1))
        decided = False
        for pick, outcome, delay in fates:
            if self.session.pending_loads():
                self.apply(StoreEvict(pick) if outcome == "evict" else Deliver(pick, outcome, delay))
                decided = True
        if decided:
            self.apply(Step(1))  # what was decided for now happens (the delayed stay pending)

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3),
                     outcome=lambda c: st.sampled_from(OUTCOMES), delay=lambda c: st.integers(0, 2))
    def deliver(self, pick, outcome, delay):
        self.apply(Deliver(pick, outcome, delay))

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3))
    def store_evict(self, pick):
        self.apply(StoreEvict(pick))

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3),
                     suffix=lambda c: strategies.tokens(c.vocab, 2), extra=lambda c: st.integers(0, 2))
    def claim_while_loading(self, pick, suffix, extra):
        """A second request for the prefix a load is bringing in."""
        loads = self.session.pending_loads()
        rid = loads[pick % len(loads)].request_id
        track = self.session.tracks.get(rid) if rid is not None else None
        if track is not None and self.fits(track.prompt_len + extra, 1):
            self.apply(Submit(self.new_id(), track.tokens[: track.prompt_len] + suffix[:extra], 1))

    @configured_rule(precondition=lambda self: self._loading(), pick=lambda c: st.integers(0, 3))
    def abort_loading(self, pick):
        loads = self.session.pending_loads()
        rid = loads[pick % len(loads)].request_id
        if rid in self.session.active():
            self.apply(Abort(rid))

    @configured_rule(precondition=lambda self: self._loading(),
                     prompt=lambda c: strategies.tokens(c.vocab, max(2 * c.B, c.num_kv_blocks // 3 * c.B - 1)))
    def evict_while_loading(self, prompt):
        """Local eviction while a load is in flight: a distinct prompt's
        allocations meet the blocks the load targets or the entries it joins."""
        prompt = prompt[: self.max_len - 1]
        if self.fits(len(prompt), 1):
            self.apply(Submit(self.new_id(), prompt, 1))
        self.apply(Step(1024))

    @configured_rule(precondition=lambda self: self.enabled("transfers") and self.session is not None
                     and not self.session.active(),
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     length=lambda c: st.integers(c.max_len // 2, c.max_len - 1), k=lambda c: st.integers(1, 2),
                     offset=lambda c: st.integers(1, max(1, c.B - 1)), more=lambda c: st.integers(0, 1),
                     fate=lambda c: st.sampled_from(("ok", "evict", "ok", "fail", "ok", "short")))
    def local_tail_against_remote(self, seed, length, k, offset, more, fate):
        """The tiers' fourth case: a local hit ending inside block ``k``
        against the host tier's hit at that block's end.  A prompt is cached,
        then a prefix of it ending inside the block; distinct junk displaces
        the older entries (the state at the boundary goes to the host tier)
        but not the younger, mid-block one: it takes as many state slots as
        the pool has beyond the prompt's checkpoints (one per block, the
        densest a cache keeps), so an LRU keeps the entry cached last.  Then
        the prompt up to the boundary and one diverging token is asked for,
        and its load decided (``fate``) before it runs.  The tokens come from
        ``seed`` (a few draws instead of two prompts' worth)."""
        B, cut, vocab = self.B, k * self.B, self.model.config.vocab_size
        if cut >= length:
            return
        rng = random.Random(seed)
        a = tuple(rng.randrange(vocab) for _ in range(length))
        blocks = min(self.max_len // B, max(1, self.impl_config.num_state_slots - -(-length // B) + more))
        junk = ((a[0] + 1 + rng.randrange(max(1, vocab - 1))) % vocab,) + tuple(  # never A's start
            rng.randrange(vocab) for _ in range(blocks * B - 2))
        other = (a[cut] + 1 + rng.randrange(max(1, vocab - 1))) % vocab  # never A's token after the boundary
        for i, seq in enumerate((a, a[: cut - B + offset], junk, a[:cut] + (other,))):
            if self.fits(len(seq), 1):
                self.apply(Submit(self.new_id(), seq, 1))
                if i == 3:
                    self.apply(Step(1))  # the tiers are compared, the loads issued
                    if self.session.pending_loads():
                        self.apply(StoreEvict(0) if fate == "evict" else Deliver(0, fate, 0))
                self.apply(Drain(1024))


#: Rule groups a check adds by name, beyond the base machine's.  Hypothesis
#: picks rules by their index among the class's rules, so a check that enables
#: none of them runs the base machine's rules only (its draws stay as they were).
OPTIONAL_GROUPS: tuple[tuple[type, frozenset[str]], ...] = (
    (HardHistories, frozenset({"live-pressure", "burst", "aba", "diverge", "live-abort"})),
    (Transfers, frozenset({"transfers"})),
)


class HybridCacheMachine(Prompts, Steps, Aborts, Pressure):
    """Every rule group; ``spec.rules`` enables the optional ones.

    ``HybridCacheMachine(impl_factory, spec, model=..., oracle=...,
    impl_config=..., timeout=..., recorder=..., attach=...)``."""


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


def hypothesis_settings(examples: int, steps: int, database=None, shrink: bool = True) -> settings:
    # shrink=False: the caller minimizes the failing operations itself (conformance.suite.minimize)
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p is not Phase.shrink)
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=database, phases=phases,
                    derandomize=False, report_multiple_bugs=False, print_blob=False,
                    suppress_health_check=list(HealthCheck))
