"""Speculative decoding in the reference cache (``options={"spec_tokens": k}``).

A recurrent state cannot be trimmed, so a step that verifies k drafts needs a
state for every length it may accept.  Two schemes, both correct:

- ``"per-position"`` (the default, as vLLM's speculative state blocks): a
  request holds its running slot and up to k *spare* slots.  A verification
  step writes the state after its last real token into the running slot and
  the state after draft i into spare i; the column of the accepted length then
  becomes the running slot (the others are spares again).  Nothing is copied.
- ``"rollback"``: the running slot is extended through every draft in place,
  after a snapshot of the state at the drafts' start into one spare slot; when
  a draft was rejected the request resumes from that snapshot and recomputes
  the accepted drafts (mlx-lm's exact-rollback API).

Caching happens only at accepted boundaries: blocks are registered by the
accepted length, and a checkpoint inside the accepted range is registered from
the column that holds it; a rejected draft's KV and state are never
published.  Under ``spec_drop_block`` (EAGLE / MTP) a prefix hit gives its
last block back for the drafter to recompute, in *both* groups: the state is
reconciled to the shortened KV hit.

Each decision is one small method, so that a mutant overrides exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from conformance.contract import Speculation

if TYPE_CHECKING:
    from conformance.adapters.reference.policy import RetentionPolicy
    from conformance.adapters.reference.state_pool import StatePool

SCHEMES = ("per-position", "rollback")


@dataclass(frozen=True)
class SpecOptions:
    tokens: int = 0  # drafts verified per step at most (0: no speculative decoding)
    scheme: str = "per-position"
    drop_block: bool = False

    @classmethod
    def from_options(cls, options: dict) -> SpecOptions:
        k = options.get("spec_tokens", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"spec_tokens must be an integer >= 0, got {k!r}")
        scheme = options.get("spec_scheme", "per-position")
        if scheme not in SCHEMES:
            raise ValueError(f"spec_scheme must be one of {SCHEMES}, got {scheme!r}")
        drop = options.get("spec_drop_block", False)
        if not isinstance(drop, bool):
            raise ValueError(f"spec_drop_block must be true or false, got {drop!r}")
        return cls(k, scheme, drop)


class SpeculativeDecoding:
    """The reference cache's speculative decoding (mixed into ReferenceCache;
    ``self.spec`` holds its options)."""

    spec: SpecOptions
    B: int
    if TYPE_CHECKING:  # what it uses of the cache it is mixed into (ReferenceCache)
        states: StatePool
        policy: RetentionPolicy
        stats: dict[str, int]

        def _find(self, request_id: str) -> Any: ...

        def _register_blocks(self, req: Any) -> None: ...

        def _sighted(self, req: Any, pos: int) -> bool: ...

        def _register_snapshot(self, req: Any) -> None: ...

        def _should_admit(self, prefix: tuple[int, ...]) -> bool: ...

    # -- contract ------------------------------------------------------------------
    def speculation(self) -> Speculation | None:
        if not self.spec.tokens:
            return None
        scheme = cast(Literal["per-position", "rollback"], self.spec.scheme)
        return Speculation(self.spec.tokens, scheme, self.B if self.spec.drop_block else 0)

    def propose_drafts(self, request_id: str, tokens: tuple[int, ...]) -> None:
        req = self._find(request_id)
        req.proposed = tuple(tokens[: self.spec.tokens])

    # -- planning a step -----------------------------------------------------------
    def _drafts_for(self, req, end: int, room: int) -> tuple[int, ...]:
        """The drafts this step verifies: a prefix of the proposal, when the
        step reaches the last known token, within the token budget."""
        if not req.proposed or end != len(req.tokens) or room <= 0:
            return ()
        return req.proposed[: min(room, self.spec.tokens)]

    def _resume_slot(self, req, has_drafts: bool) -> int | None:
        """The slot holding the state at ``computed`` when it is not the
        running slot (the accepted column of the last verification)."""
        return req.resume_slot

    def _resume(self, req, has_drafts: bool) -> None:
        """The accepted column becomes the running slot; the old one a spare."""
        src = self._resume_slot(req, has_drafts)
        req.resume_slot = None
        if src is None or src == req.slot:
            return
        if src in req.spare:
            req.spare.remove(src)
        if req.slot is not None:
            req.spare.append(req.slot)
        req.slot = src

    def _spare_slots(self, req, n: int) -> list[int]:
        """Up to ``n`` spare slots the request holds, allocating what it lacks
        (counted in its refcounts: they are its own)."""
        while len(req.spare) < n:
            slot = self.states.allocate()
            if slot is None:
                break
            req.spare.append(slot)
        return req.spare[:n]

    def _verification(self, req, end: int, drafts: tuple[int, ...]):
        """(drafts, draft slots, snapshots) of the step: per-position, one spare
        per draft; rollback, a snapshot at ``end`` into one spare."""
        if not drafts:
            return (), (), ()
        if self.spec.scheme == "rollback":
            spare = self._spare_slots(req, 1)
            return (drafts, (), ((end, spare[0]),)) if spare else ((), (), ())
        slots = self._spare_slots(req, len(drafts))
        return drafts[: len(slots)], tuple(slots), ()

    # -- after a verification --------------------------------------------------------
    def _columns(self, step, accepted: int) -> tuple[int, list[tuple[int, int]]]:
        """(the length the request has computed, [(position, slot)]: where the
        state of each accepted position lives)."""
        end, k = step.end, len(step.drafts)
        if self.spec.scheme == "rollback":
            rollback = step.snapshots[0][1]
            if accepted == k:  # nothing to roll back: the running slot is right
                return end + k, [(end, rollback), (end + k, step.state_slot)]
            return end, [(end, rollback)]  # resume from the snapshot, recompute the accepted drafts
        cols = (step.state_slot, *step.draft_slots)
        return end + accepted, [(end + j, cols[j]) for j in range(accepted + 1)]

    def _verified(self, req, step, accepted: int, sampled: int | None) -> None:
        """Record a verification: the accepted drafts join the sequence, the
        blocks are registered by the accepted length only, checkpoints inside
        the accepted range are registered from their columns, and the column
        at the accepted length is where the request resumes.  ``sampled``: the
        token after the accepted drafts (its state is computed by the next step)."""
        req.tokens.extend(step.drafts[:accepted])
        req.generated += accepted
        req.computed, columns = self._columns(step, accepted)
        self._register_blocks(req)
        holder = columns[-1][1] if columns[-1][0] == req.computed else None
        for pos, slot in columns:
            if pos == req.computed or not (self.policy.is_checkpoint(pos, req.prompt_len, self.B)
                                           or self._sighted(req, pos)):
                continue
            if self._register_column(req, slot, pos):
                self._drop_slot(req, slot)
        if holder is not None:
            req.resume_slot = holder
        if (self.policy.is_checkpoint(req.computed, req.prompt_len, self.B) or self._sighted(req, req.computed)) \
                and holder is not None:
            self._resume(req, True)
            self._register_snapshot(req)

    def _register_column(self, req, slot: int, pos: int) -> bool:
        """Register the state in ``slot`` (after ``pos`` tokens) in place."""
        prefix = tuple(req.tokens[:pos])
        if not self._should_admit(prefix):
            return False
        if self.states.register(prefix, slot):
            self.stats["snapshots"] += 1
            return True
        return False

    def _drop_slot(self, req, slot: int) -> None:
        """A column that became a cached snapshot is no longer the request's."""
        if slot in req.spare:
            req.spare.remove(slot)
        elif slot == req.slot:
            req.slot = None
        else:
            return
        self.states.release(slot)

    def _release_spare(self, req) -> None:
        for slot in req.spare:
            self.states.release(slot)
        req.spare = []
        req.resume_slot = None

    # -- prefix hits -------------------------------------------------------------------
    def _hit_kv_length(self, kv_len: int) -> int:
        """EAGLE / MTP: a non-zero hit gives its last block back, for the
        drafter to recompute its hidden states (vLLM's drop_eagle_block)."""
        if self.spec.tokens and self.spec.drop_block and kv_len > 0:
            return max(0, kv_len - self.B)
        return kv_len
