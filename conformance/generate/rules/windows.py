"""Sliding-window histories (issue 35), built whole by one rule each, as the
hard histories of :mod:`conformance.generate.rules.targeted` are: from the
facts the session exposes (its tracks, its memory's provenance), never from
a checker's counter, once an example.  Their coverage is counted by
:class:`conformance.judge.windows.WindowCoverage`.

- ``window-freed``: a prompt longer than every window (ending inside a
  block) is prefilled, its first blocks leaving the windows on the way, and
  decodes while distinct prompts run beside it, one at a time, until memory
  no longer holds, in some window group, a position of it (what it let go was
  written over while it ran); it runs to its end; then its whole sequence,
  extended by a few tokens, is asked for (a hit past the window after its
  blocks were freed, the window's blocks at the hit point its last ones);
  drawn, that request is aborted after one step (an abort mid-window).
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from conformance.generate.configured import configured_rule
from conformance.generate.rules.base import MachineBase
from conformance.harness.ops import Abort, Drain, Step, Submit
from conformance.judge.reuse import INDEXES


class Windows(MachineBase):
    """Sliding-window histories (see the module's docstring)."""

    @configured_rule(precondition=lambda self: self.enabled("window-freed") and self.session is not None
                     and "window-freed" not in self.built and bool(self.session.memory.windows),
                     seed=lambda c: st.integers(0, 2**32 - 1),
                     offset=lambda c: st.integers(1, c.B - 1),
                     more=lambda c: st.integers(1, c.B - 1),
                     abort=lambda c: st.booleans())
    def window_freed_hit(self, seed, offset, more, abort):
        """See the module's docstring (``window-freed``)."""
        self.built.add("window-freed")
        rng, B = random.Random(seed), self.B
        windows = self.session.memory.windows
        if self.busy():
            self.apply(Drain(1024))
        # the longest prompt the check draws, past every window by a block at least, ending inside a block
        blocks = max(-(-max(windows) // B) + 1, self.spec.max_prompt_blocks)
        prompt = self._window_tokens(rng, (blocks - 1) * B + offset)
        past = max(windows)
        for _ in range(2):
            track = self._decode_beside_fillers(rng, prompt, blocks)
            if track is None:
                return
            seq = track.tokens
            if any(len(p) > past and seq[: len(p)] == p for p in INDEXES.get(self.session.last_view, B).states):
                break
            # no state of it past the windows listed: under second-hit admission the prompt needs a
            # second sighting (the reference under admission second-hit: window_hits_past_freed 0 at
            # seeds 0-4), and it runs again as it ran (the same tokens, the same decode)
        rid = self.new_id()
        if not self._window_submit(seq + self._window_tokens(rng, more), 2, rid):
            return
        if abort:
            self.apply(Step(1024))
            self.apply(Abort(rid))
        else:
            self.apply(Drain(1024))

    # -- helpers ---------------------------------------------------------------------------
    def _decode_beside_fillers(self, rng: random.Random, prompt: tuple[int, ...], blocks: int):
        """``prompt`` decodes while distinct one-block prompts run beside it, one at a time, until
        memory no longer holds a position of it in some window group; then it runs to its end.
        Its track, or None where it does not fit."""
        B, rid = self.B, self.new_id()
        # decoding as long as the check allows, leaving room to ask for the whole sequence again
        if not self._window_submit(prompt, max(1, min(self.max_len - len(prompt) - B - 2, 3 * B)), rid):
            return None
        track = self.session.tracks[rid]
        for _ in range(4 * blocks):  # into decode: its first blocks left every window
            if track.done or (track.computed or 0) >= track.prompt_len:
                break
            self.apply(Step(B))
        for _ in range(self.impl_config.num_kv_blocks):
            if track.done or self._window_freed(prompt):
                break
            filler = self.new_id()
            if not self._window_submit(self._window_tokens(rng, B + 1, avoid=prompt[0]), 1, filler):
                break
            for _ in range(8):  # the filler runs to its end beside the decoding request
                if self.session.tracks[filler].done:
                    break
                self.apply(Step(1024))
        self.apply(Drain(1024))
        return track

    def _window_tokens(self, rng: random.Random, n: int, avoid: int | None = None) -> tuple[int, ...]:
        vocab = self.model.config.vocab_size
        first = rng.randrange(vocab)
        if avoid is not None and first == avoid:
            first = (first + 1) % vocab
        return (first, *(rng.randrange(vocab) for _ in range(n - 1)))

    def _window_submit(self, prompt, max_new: int, rid: str | None = None) -> bool:
        if not self.fits(len(prompt), max_new):
            return False
        self.apply(Submit(rid or self.new_id(), tuple(prompt), max_new))
        return True

    def _window_freed(self, prompt: tuple[int, ...]) -> bool:
        """Memory no longer holds, in some window group, the KV of a position of
        ``prompt`` (its blocks were let go and written over)."""
        mem = self.session.memory
        for g in range(len(mem.windows)):
            have = {p for row in mem.win_prov[g] for p in row if p is not None}
            if any(prompt[: q + 1] not in have for q in range(len(prompt))):
                return True
        return False
