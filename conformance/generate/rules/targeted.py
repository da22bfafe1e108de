"""Histories a uniform draw reaches at some seeds only, built whole by one
rule each (issue 25), so that a check reaches them at every seed.

Each rule builds its history from the facts the session exposes (its tracks,
its memory's provenance, the entries evicted so far), never from a checker's
counter, and draws only a seed for its tokens and a few shape parameters:
one draw of the rule is one whole history.  Each runs at most once an
example (``MachineBase.built``): a history costs tens of steps, and its
second occurrence in one example adds little to the first.  Their coverage is counted by
:class:`conformance.judge.memory_coverage.MemoryHistoryCoverage`.

- ``evict-running``: a request decodes with its prompt's blocks published;
  a younger entry is published after them; then distinct prompts as long as
  the pool allows arrive while it decodes, until the younger entry's content
  is overwritten: an eviction that went past the running request's entry;
- ``abort-copy``: a prompt ending inside a block is cached; a longer prompt
  hits it (a copy-on-write of that block), runs one token and is aborted
  before it completed the copied block; then another prompt hits the same
  prefix, runs one token (an off-grid stop after a mid-block hit) and runs to
  its end;
- ``kv-first``: a prompt's KV is evicted, one block-sized prompt at a
  time (drawn: each starting with the prompt's first block, which keeps it
  held), until memory holds a state of it past the KV it still holds; then
  the prompt is asked for again, longer;
- ``tier-tail``: the tiers' fourth case with the loads left to the transport
  (``Transfers.local_tail_against_remote`` decides them): a local hit ending
  inside a block against the host tier's hit at that block's end; drawn
  (``evict_kv``), the device's KV of that block is displaced first, one
  block-sized prompt at a time, while a shorter local hit stays listed.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from conformance.generate import strategies
from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.draws import displace_boundary_state, tail_against_remote
from conformance.harness.ops import Abort, Drain, Step, Submit
from conformance.judge.memory_coverage import Held
from conformance.judge.reuse import INDEXES


class Targeted(MachineBase):
    """Histories built whole by one rule each (see the module's docstring)."""

    # -- evict-running ---------------------------------------------------------------------
    @configured_rule(precondition=lambda self: self.enabled("evict-running") and self.session is not None
                     and "evict-running" not in self.built,
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     blocks=lambda c: st.integers(1, max(1, c.spec.max_prompt_blocks // 2)),
                     offset=lambda c: st.integers(0, c.B - 1), hit=lambda c: st.booleans())
    def evict_past_running_entry(self, seed, blocks, offset, hit=False):
        """A request decodes while its published blocks are cached entries
        only it holds; distinct prompts, each as long as the pool allows, run
        to their end beside it (younger entries: released after everything
        else the pool holds, never-used blocks included); then one more runs
        beside it until memory no longer holds the first block of a younger
        entry: eviction went past the running request's entries, which an
        order by age that forgot the request's reference would have taken
        first (issue 25's first history).  Every example's pool starts
        unused, so the history costs about a pool's worth of allocations: a
        cache that prefills a block a step (the reference cuts chunks at its
        checkpoints) takes about as many steps, which is why the younger
        prompts run together and the rule runs once an example.  The
        decoding request asks for as many tokens as that takes; it is
        aborted at the end (mid-decode).  A prompt the cache does not start
        beside it (a pool shared with states) is aborted and retried shorter.

        With ``hit`` (issue 37, a) the decoding request's prompt is a prefix
        hit: the prompt less its last token runs to its end first, so the
        blocks the request reads were cached and unreferenced before its hit
        took them; the younger entries the rule then overwrites were listed
        after them.  A hit that takes a cached block without removing it
        from its free queue leaves the block where its age puts it, and that
        eviction takes it first while the request still reads it."""
        self.built.add("evict-running")
        rng = random.Random(seed)
        B = self.B
        if self.busy():
            self.apply(Drain(1024))
        a = self._distinct(rng, blocks * B + offset + 1)
        max_new = max(self.spec.max_new_tokens, min(self.max_len - len(a), self.impl_config.num_kv_blocks))
        if not self.fits(len(a), max_new):
            return
        if hit and self._submit_fits(a[:-1], 1):
            self.apply(Drain(1024))  # its blocks cached, then hit by the decoding request
        rid = self.new_id()
        self.apply(Submit(rid, a, max_new))
        for _ in range(self.spec.max_seq_blocks + 1):
            self.apply(Step(1024))
            if self._past_prefill(rid):
                break
        young = self._beside(rng, rid, self.spec.max_active - 1, lambda ids: all(
            self.session.tracks[y].done for y in ids))
        if young:
            heads = [self.session.tracks[y].tokens[:B] for y in young]
            self._beside(rng, rid, 1, lambda _: not all(self._holds(h) for h in heads))
        self.apply(Abort(rid))

    def _beside(self, rng: random.Random, running: str, count: int, until) -> list[str]:
        """Up to ``count`` distinct one-token prompts sharing the room
        :meth:`fits` leaves, stepped beside ``running`` until ``until(their
        ids)`` holds, they finish or ``running`` does.  One the cache does not
        start beside ``running`` is aborted and tried again two blocks
        shorter.  Their ids."""
        B, ids = self.B, []
        for n in range(count, 0, -1):
            for shrink in range(0, 3 * 2 * B, 2 * B):
                length = (self._longest_fit() + 1) // n - 1 - shrink  # the room shared by those to come
                if length < 2 * B or self.session.tracks[running].done:
                    break
                rid = self.new_id()
                self.apply(Submit(rid, self._distinct(rng, length), 1))
                self.apply(Step(1024))
                if self.session.tracks[rid].computed is not None:
                    ids.append(rid)
                    break
                self.apply(Abort(rid))  # it waits: no room beside the running request
        for _ in range(self.spec.max_seq_blocks + self.impl_config.num_kv_blocks):
            if not ids or until(ids) or self.session.tracks[running].done \
                    or all(self.session.tracks[r].done for r in ids):
                break
            self.apply(Step(1024))
        return ids

    # -- abort-copy ------------------------------------------------------------------------
    @configured_rule(precondition=lambda self: self.enabled("abort-copy") and self.session is not None
                     and "abort-copy" not in self.built,
                     base=lambda c: st.integers(0, 2),
                     blocks=lambda c: st.integers(1, max(1, c.spec.max_prompt_blocks - 2)),
                     offset=lambda c: st.integers(1, max(1, c.B - 2)),
                     rest=lambda c: strategies.tokens(c.vocab, c.B + 1),
                     max_new=lambda c: st.integers(1, c.spec.max_new_tokens))
    def abort_before_copy_complete(self, base, blocks, offset, rest, max_new):
        """A cached prompt ending inside a block with room left in it (its
        prompt-end state is a checkpoint: a finished request's, or one run
        now from a shared base); a prompt one token past that block's end
        hits it, runs one token (its copy of the hit's block is not complete)
        and is aborted; another prompt with the same prefix and another next
        token hits it again, runs one token and then to its end.  Alone in
        the pool, so that the one-token steps are theirs.  Then (issue 37,
        h) a third one is admitted behind a running request that takes the
        step's token, and aborted before its first chunk."""
        self.built.add("abort-copy")
        B, tracks = self.B, self.session.tracks
        if self.busy():
            self.apply(Drain(1024))
        done = [r for r in self.finished if 0 < tracks[r].prompt_len % B <= B - 2]
        if done:
            prefix = tracks[done[base % len(done)]].tokens[: tracks[done[base % len(done)]].prompt_len]
        else:
            prefix = self.bases[base][: blocks * B + offset]
            self._submit_fits(prefix, 1)
            self.apply(Drain(1024))
        if prefix not in INDEXES.get(self.session.last_view, B).states:
            # its prompt-end state not cached: under second-hit admission it needs a second sighting
            # (the reference under admission second-hit, seed 0: the abort-copy histories stayed at 0)
            self._submit_fits(prefix, 1)
            self.apply(Drain(1024))
        past = rest[: B - len(prefix) % B + 1]  # through the copied block's end and one token more
        first = self.new_id()
        if not self._submit_fits(prefix + past, 1, first):
            return
        self.apply(Step(1))
        self.apply(Abort(first))  # mid-prefill: one token past the hit, or none
        other = ((past[0] + 1 + rest[-1] % (self.vocab - 1)) % self.vocab,)  # never the aborted one's token
        # With 2-token blocks one token from a hit inside a block ends on the block's end: two tokens
        # then (and two more of the prompt after them), so that the chunk stops inside the next block.
        chunk, more = (1, past[1:]) if B > 2 else (2, rest[1:])
        if self._submit_fits(prefix + other + more, max_new):
            self.apply(Step(chunk))
            self.apply(Drain(1024))
        # (issue 37, h) a third hit, behind a running request that takes the step's one token: it is
        # aborted after the step that admitted it (its copy-on-write made), before its first chunk, the
        # only moment its copy is incomplete where a cache runs a hit's first chunk to the block's end
        alt = ((past[0] + 1 + (rest[-1] + 1) % (self.vocab - 1)) % self.vocab,)  # neither token above
        if self._submit_fits(self._distinct(random.Random(rest[-1]), 2 * B), 2):
            self.apply(Step(1))  # running: the next step's budget is its
            third = self.new_id()
            if self._submit_fits(prefix + alt + past[1:], 1, third):
                self.apply(Step(1))
                self.apply(Abort(third))
            self.apply(Drain(1024))

    # -- tier-tail -------------------------------------------------------------------------
    @configured_rule(precondition=lambda self: self.enabled("tier-tail") and self.session is not None
                     and "tier-tail" not in self.built,
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     length=lambda c: st.integers(c.max_len // 2, c.max_len - 1), k=lambda c: st.integers(2, 3),
                     offset=lambda c: st.integers(1, max(1, c.B - 1)), more=lambda c: st.integers(0, 1),
                     evict_kv=lambda c: st.booleans())
    def remote_beats_local_tail(self, seed, length, k, offset, more, evict_kv=False):
        """The tiers' fourth case, the loads left to the transport: a prompt
        and a prefix of it ending inside block ``k`` are cached, junk displaces
        the older entries to the host tier, then the prompt up to that block's
        end and a diverging token is asked for: the local hit ends inside the
        block, the host tier holds the block's end.  Drained between requests.
        ``k`` >= 2, so that where hits end on block boundaries only (vLLM's
        default match unit) the local hit is the block before, not nothing:
        the remote tier still beats a local hit.

        The prompt up to block ``k``'s end runs on its own too (after the
        first): a cache that keeps states only where a prompt or a
        block-aligned chunk ends (vLLM's align mode, its connector saving a
        state only at a step's block-aligned end) holds nothing at that
        block's end from a longer prompt.  With ``evict_kv``, before the last
        prompt, distinct one-block prompts run one at a time while the listed
        KV still reaches that block's end and a local hit stays listed: a
        cache that reconciles a hybrid hit by its attention hit (vLLM's
        divergent connector path drops a host state at or below it) takes
        the host tier's state only once the device's KV stops short of it,
        and a cache whose states go before its KV (the reference) keeps its
        local hit only without it, hence a draw, not always."""
        self.built.add("tier-tail")
        if self.busy():
            self.apply(Drain(1024))
        seqs = tail_against_remote(self, seed, length, k, offset, more, block_end=True)
        for seq in seqs[:-1]:
            self._submit_fits(seq, 1)
            self.apply(Drain(1024))
        if not seqs:
            return
        last, cut = seqs[-1], k * self.B
        displace_boundary_state(self, seqs[0], cut, seqs[-2])
        rng = random.Random(seed ^ 0x7E1)
        for _ in range(self.impl_config.num_kv_blocks if evict_kv else 0):
            index = INDEXES.get(self.session.last_view, self.B)
            if index.kv_servable(last) < cut or index.best_reuse(last) == 0:
                break
            self._submit_fits(self._distinct(rng, self.B + 1), 1)  # one full block (a partial one is reused at once)
            self.apply(Drain(1024))
        self._submit_fits(last, 1)
        self.apply(Drain(1024))

    # -- kv-first --------------------------------------------------------------------------
    @configured_rule(precondition=lambda self: self.enabled("kv-first") and self.session is not None
                     and "kv-first" not in self.built,
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     blocks=lambda c: st.integers(min(3, max(2, c.spec.max_seq_blocks - 2)),
                                                  max(2, c.spec.max_seq_blocks - 2)),
                     suffix=lambda c: strategies.tokens(c.vocab, 2),
                     keep_head=lambda c: st.booleans())
    def evict_kv_keep_state(self, seed, blocks, suffix, keep_head=False):
        """A prompt of whole blocks (three blocks or more, as the check allows:
        the longer, the more KV blocks go before its states; on vLLM two
        blocks went with their states in one step) runs to its end, and again
        with a token more (a hit: what served it is the latest used);
        distinct one-block prompts follow, one at a time, until memory no longer holds part of
        its KV while the cache still lists a state of it (memory holding it
        too) past the KV memory holds; then the prompt and two tokens more
        are asked for (vllm#46453: the attention group evicted, a deeper
        recurrent state survived).  Where one pool serves both (vLLM), the KV
        goes first only for a while: a request's blocks are freed group by
        group, attention first (``KVCacheCoordinator.free``), and checkpoint
        states a request skipped past were freed before it finished, which is
        why the hit comes first.  With ``keep_head`` the one-block prompts
        start with the prompt's first block (a shared system prompt): a hit on
        it keeps it young, so eviction by age takes the prompt's later blocks
        and a KV prefix stays held below the surviving state (the groups' hits
        disagree, both above 0); without it a cache that frees a chain head
        first (the reference) loses the KV from position 0."""
        self.built.add("kv-first")
        rng, B = random.Random(seed), self.B
        if self.busy():
            self.apply(Drain(1024))
        prompt = self._distinct(rng, blocks * B)
        for seq in (prompt, prompt + suffix[:1]):
            if not self._submit_fits(seq, 1):
                return
            self.apply(Drain(1024))
        for _ in range(self.impl_config.num_kv_blocks):
            held = Held(self.session.memory)
            listed = INDEXES.get(self.session.last_view, B).states & held.states
            states = [q for q in range(1, len(prompt) + 1) if prompt[:q] in listed]
            if not states:
                return  # the states went first
            if states[-1] > held.kv_len(prompt):
                break  # a state outlives the KV before it
            head = prompt[:B] if keep_head else ()
            self._submit_fits(head + self._distinct(rng, B + 1), 1)  # one full block (a partial one is reused at once)
            self.apply(Drain(1024))
        self._submit_fits(prompt + suffix, 1)
        self.apply(Drain(1024))

    # -- helpers ---------------------------------------------------------------------------
    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def _past_prefill(self, rid: str) -> bool:
        t = self.session.tracks[rid]
        return t.done or (t.computed is not None and t.computed >= t.prompt_len)

    def _distinct(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.vocab) for _ in range(n))

    def _holds(self, block: tuple[int, ...]) -> bool:
        """Memory still holds this prefix's KV somewhere (by provenance)."""
        pos = len(block) - 1
        return any(row[pos % self.B] == block for row in self.session.memory.kv_prov)

    def _longest_fit(self) -> int:
        """The longest one-token prompt :meth:`fits` admits now (0: none)."""
        B, cfg = self.B, self.impl_config
        active = [self.session.tracks[r] for r in self.session.active()]
        if len(active) >= self.spec.max_active or 2 * (len(active) + 1) > cfg.num_state_slots:
            return 0
        need = sum(-(-(t.prompt_len + t.max_new) // B) + 1 for t in active)
        return max(0, min(self.max_len - 1, (cfg.num_kv_blocks - need - 1) * B - 1))

    def _submit_fits(self, prompt, max_new: int, rid: str | None = None) -> bool:
        if not self.fits(len(prompt), max_new):
            return False
        self.apply(Submit(rid or self.new_id(), tuple(prompt), max_new))
        return True
