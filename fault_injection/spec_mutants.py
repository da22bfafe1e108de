"""Seeded bugs in the reference cache's speculative decoding (issue 22), each
modelled on an upstream report (``upstream-bugs.md``, class SPEC) and each a
subclass overriding one decision of
:mod:`conformance.adapters.reference.speculative`.

Their target is ``reference-spec``: they change nothing until drafts are
verified, so ``mutants`` runs them against the checks that verify drafts (the
``spec`` family), as it runs the disaggregated mode's mutants against the
disagg family.  The general checkers must catch each (the logits, the view
against memory, only the accepted prefix reusable), never a check written for
one of them."""

from __future__ import annotations

from conformance.adapters.reference.block_pool import ROOT, chain
from conformance.adapters.reference.cache import Match, ReferenceCache
from conformance.contract import copy_from
from fault_injection.registry import register, subclass_mutant

TARGET = "reference-spec"


def _subclass(factory, name: str, **methods):
    return subclass_mutant(ReferenceCache, factory, name, **methods)


@register("spec-read-column-zero", "SPEC", target=TARGET)
def spec_read_column_zero(factory):
    """After a step that accepted drafts, a step *without* drafts resumes from
    the running column (the state after the last real token), not the column
    of the accepted length: only the speculative path applies the accepted
    offset (vllm#39273: plain decode reads column 0; 0/20 exact outputs while
    acceptance looked healthy)."""

    def _resume_slot(self, req, has_drafts):
        return req.resume_slot if has_drafts else None

    return _subclass(factory, "spec-read-column-zero", _resume_slot=_resume_slot)


@register("spec-state-rejected-boundary", "SPEC", target=TARGET)
def spec_state_rejected_boundary(factory):
    """Columns are published through the accepted length *plus the bonus
    token*: where the position after the bonus token is a checkpoint, the
    column of the first rejected draft (the state after that draft) is cached
    as the state after the bonus token -- a state published under a boundary
    that includes a rejected draft."""

    def _verified(self, req, step, accepted, sampled):
        cols = (step.state_slot, *step.draft_slots)
        end = step.end
        ReferenceCache._verified(self, req, step, accepted, sampled)
        pos = end + accepted + 1
        if (accepted < len(step.drafts) and cols[accepted + 1:] and sampled is not None
                and self.policy.is_checkpoint(pos, req.prompt_len, self.B)):
            slot = cols[accepted + 1]
            if slot in req.spare and self.states.register(tuple(req.tokens[: end + accepted]) + (sampled,), slot):
                req.spare.remove(slot)
                self.states.release(slot)

    return _subclass(factory, "spec-state-rejected-boundary", _verified=_verified)


@register("spec-rollback-noop", "SPEC", target=TARGET, options={"spec_scheme": "rollback"})
def spec_rollback_noop(factory):
    """The rollback scheme's restore is a no-op: after a rejection the request
    takes the running state (extended in place through every draft) for the
    state at the accepted length and carries on from it (mlx-lm#1109:
    ``trim()`` does nothing on a recurrent ``ArraysCache``; drafts silently
    corrupt the output)."""

    def _columns(self, step, accepted):
        return step.end + accepted, [(step.end + accepted, step.state_slot)]

    return _subclass(factory, "spec-rollback-noop", _columns=_columns)


@register("spec-blocks-uncounted", "SPEC", target=TARGET)
def spec_blocks_uncounted(factory):
    """The speculative state slots are not counted in the request's table:
    a verification writes its drafts' states into the slots the free list
    would hand out next, without taking them, and the request copies the
    accepted one back (vllm#39809: the kernel touches 1 + num_speculative_blocks
    slots, the block table and state indices were sized without them).  Another
    request's allocation, or a cached snapshot in a free slot, meets them."""

    def _spare_slots(self, req, n):
        return list(self.states.free)[:n]  # the bug: looked at, never allocated

    def _resume(self, req, has_drafts):
        src = self._resume_slot(req, has_drafts)
        req.resume_slot = None
        if src is not None and src != req.slot:
            if req.slot is None:
                req.slot = self.states.allocate()
            req.init = copy_from(src)

    return _subclass(factory, "spec-blocks-uncounted", _spare_slots=_spare_slots, _resume=_resume)


@register("spec-drop-block-kv-only", "SPEC", target=TARGET, options={"spec_drop_block": True})
def spec_drop_block_kv_only(factory):
    """EAGLE / MTP's block drop is applied to the attention group's hit only:
    the recurrent group keeps the state of the undropped hit, so a request
    recomputes the dropped block on top of a state that already consumed it
    (vllm#43559 (b): ``MambaManager.find_longest_cache_hit`` takes
    ``drop_eagle_block`` and ignores it; about 20% accuracy lost with prefix
    caching and MTP)."""

    def _match(self, prompt):
        kv_len, blocks, keys = self._match_kv(prompt)
        m = self._reconcile(prompt, kv_len, blocks, keys)  # the recurrent group: no drop
        length = min(m.length, self._hit_kv_length(kv_len))  # the attention group: its last block dropped
        if length < m.length:
            return Match(length, blocks[: -(-length // self.B)], m.slot)
        return m

    return _subclass(factory, "spec-drop-block-kv-only", _match=_match)


@register("spec-draft-kv-cached", "SPEC", target=TARGET)
def spec_draft_kv_cached(factory):
    """The KV a verification step wrote for its drafts is cached like target
    KV: every block the drafts filled is registered under the drafted tokens,
    accepted or not (vllm#47930: the drafter's KV groups are cached and
    restored like the target's; acceptance collapses with prefix caching)."""

    def _verified(self, req, step, accepted, sampled):
        drafted = tuple(req.tokens[: step.end]) + tuple(step.drafts)
        ReferenceCache._verified(self, req, step, accepted, sampled)
        B, parent = self.B, ROOT
        for i in range(len(drafted) // B):
            tokens = drafted[i * B: (i + 1) * B]
            if i < len(req.blocks):
                self.kv.register(parent, tokens, drafted[: (i + 1) * B], req.blocks[i])
            parent = chain(parent, tokens)

    return _subclass(factory, "spec-draft-kv-cached", _verified=_verified)
