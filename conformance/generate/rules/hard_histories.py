"""The histories a uniform draw almost never reaches (issue 14)."""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.draws import DIVERGING, asked_again, junk_prompts
from conformance.harness.observation import Track
from conformance.harness.ops import Abort, Drain, Step, Submit
from conformance.judge.memory_coverage import Held


class HardHistories(MachineBase):
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
        evicted = self.session.evicted  # the session's fact, not a checker's counter
        rounds = min(self.vocab, self.session.layout.num_kv_blocks // -(-len(prompt) // self.B) + 1)
        for i in range(rounds):
            if i and (self.session.evicted > evicted or not self.busy()):
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
                     which=lambda c: st.integers(0, 7), junk=junk_prompts)
    def displaced_and_requested_again(self, which, junk):
        """A -> B -> A: a finished prompt, displaced by distinct prompts, asked
        for again.  Displaced means memory lost some of what could serve it
        (by provenance: the KV and a state of its longest prefix held whole),
        not that the cache evicted something: until it has, another distinct
        prompt (the last one, every token shifted) follows, at most as many
        as the KV pool the implementation reports could hold.  A cache that
        evicts never-used blocks first and keeps one pool for KV and states
        (vLLM) can hold a prompt through a few pool-sized prompts."""
        prev = self.session.tracks[self.finished[which % len(self.finished)]]
        asked = asked_again(self.session.memory, prev)  # (or as its next turn: prompt-end retention)
        held = Held(self.session.memory).reuse(asked)
        junk = [prompt[: self.longest_alone()] for prompt in junk]  # (the pool bounds it where it is small)
        for prompt in junk:
            self.apply(Submit(self.new_id(), prompt, 1))
            self.apply(Drain(1024))
        rounds = self.session.layout.num_kv_blocks // -(-len(junk[-1]) // self.B) + 1
        for i in range(1, rounds + 1 if held else 0):
            if Held(self.session.memory).reuse(asked) < held:
                break
            self.apply(Submit(self.new_id(), tuple((t + i) % self.vocab for t in junk[-1]), 1))
            self.apply(Drain(1024))
        self._submit_if_fits(asked, 1)
        if self.enabled("transfers"):
            self.apply(Step(1))  # the tier issues its loads: they are pending for the rules of Transfers

    @configured_rule(precondition=lambda self: self.enabled("diverge") and self.session is not None
                     and self.session.tracks, **DIVERGING)
    def diverge_inside_a_block(self, which, k, offset, tail, rest, max_new):
        """A prompt that agrees with an earlier sequence up to ``k*B + offset``
        (or up to one token into that sequence's partial tail) and differs at
        the next token: a divergence at every offset inside a block.  One
        draw in three submits the sequence cut there instead (a prompt whose
        hit ends inside a block).  A tail's prompt that does not fit beside
        the running requests waits for them to finish: drawn less often than
        the other offsets, it was lost to a busy pool (vLLM's GDN variant at
        seed 8: 4 tail draws in 25 examples, none fitted, tail_divergences 0)."""
        made = self._diverging(which, k, offset, tail, rest, max_new)
        if made is not None and tail and not self.fits(len(made[0]), made[1]):
            self.apply(Drain(1024))
            made = self._diverging(which, k, offset, tail, rest, max_new)  # the sequences grew
        if made is not None:
            self._submit_if_fits(*made)

    def _diverging(self, which, k, offset, tail, rest, max_new) -> tuple[tuple[int, ...], int] | None:
        """The prompt of :meth:`diverge_inside_a_block` and its max_new, or None."""
        rids = list(self.session.tracks)
        seq = self.session.tracks[rids[which % len(rids)]].tokens
        # A partial tail is the memory's: the layout's block, which an adapter may derive larger
        # than the check's (vLLM's GDN spec: 8 where the check asks 4; at seed 4 tail_divergences
        # stayed at 0 in 25 examples of that variant when this drew on the check's block).
        lb = self.session.layout.block_size
        if tail:  # among the sequences that have a partial tail to diverge inside
            tails = [t.tokens for t in self.session.tracks.values() if len(t.tokens) % lb > 1]
            seq = tails[which % len(tails)] if tails else seq
        at = len(seq) // lb * lb + 1 if tail and len(seq) % lb > 1 else k * self.B + offset
        if not 0 < at < len(seq):
            return None
        if rest[0] % 3 == 0 and at % self.B and not tail:
            # or the cached sequence cut there: a prompt whose hit ends inside a block (never
            # for a tail: Hypothesis draws rest[0] = 0 often, and the tail's divergence went with it)
            return seq[:at], max_new
        other = (seq[at] + 1 + rest[0] % (self.vocab - 1)) % self.vocab  # never the cached token
        # the tokens after the divergence give way where the prompt would not fit: a long
        # sequence's tail is where the divergence is drawn (with 8-token blocks a 57-token
        # divergence and its 7 more tokens would pass a 64-token limit)
        max_new = max(1, min(max_new, self.max_len - at - 1))
        return (seq[:at] + (other,) + rest[1:])[: max(at + 1, self.max_len - max_new)], max_new

    @configured_rule(precondition=lambda self: self.enabled("live-abort") and self.busy(),
                     which=lambda c: st.integers(0, 7), decode=lambda c: st.booleans(),
                     budget=lambda c: st.sampled_from(sorted({1, 2, c.B - 1, c.B + 1} - {0})))
    def abort_running(self, which, decode, budget):
        """Abort a request that has run: mid-decode, or mid-prefill (after its
        hit, which the step budget cuts short).  Steps first until it is there.
        Mid-decode only a request that asked for two tokens or more: one that
        asked for one finishes in the step that ends its prefill."""
        tracks = self.session.tracks
        # The kind aborted fewer times in this example goes first (the draw breaks ties): a
        # boolean left to Hypothesis drew mid-decode at all ten calls of seed 3 under interval 0
        # (aborts_mid_prefill 0 over 25 examples), and each kind is a history the check requires.
        made = getattr(self, "_aborts_made", None) or {True: 0, False: 0}
        self._aborts_made = made
        if made[True] != made[False]:
            decode = made[True] < made[False]

        def in_prefill(t: Track) -> bool:  # not run yet, or not past its prompt
            return t.computed is None or t.computed < t.prompt_len

        active = [r for r in self.session.active() if (tracks[r].max_new > 1 if decode else in_prefill(tracks[r]))]
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
                made[decode] += 1
                return
            if not decode and t.computed is not None:
                return  # its prefill is over
            # ahead of it, a decoding request takes a token and one in prefill at most a block's
            # chunk (where a cache cuts chunks at block checkpoints; under prompt-end retention,
            # interval 0, it may take more, and this one waits a step): a decoder counted as a
            # block left the rest to this one, which then ran its whole prompt in one step
            # (the reference at interval 0, seed 3: aborts_mid_prefill 0 over 25 examples)
            self.apply(Step(1024 if decode else self._ahead(rid) + budget))

    def _ahead(self, rid: str) -> int:
        """Tokens the other active requests take in a step before ``rid`` gets
        its share: one for a decoding request, a block for one in prefill."""
        tracks = self.session.tracks
        return sum(1 if t.computed is not None and t.computed >= t.prompt_len else self.B
                   for r in self.session.active() if r != rid for t in (tracks[r],))

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def _submit_if_fits(self, prompt, max_new) -> None:
        if self.fits(len(prompt), max_new):
            self.apply(Submit(self.new_id(), tuple(prompt), max_new))
