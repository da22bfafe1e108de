"""Speculative decoding, judged: what may be reused after a verification step,
and the coverage of the situations the ``spec`` family asks for.

The logits checker already judges every verified position (a verification
step's logits run through its drafts) and every later step that resumes from
the accepted state; the view checker already holds every cached entry to what
memory holds.  One rule is left, and it is this module's:

- **only the accepted prefix is reusable** (:class:`AcceptedPrefixOnly`): a
  KV block or a state the cache lists as reusable must not describe a prefix
  that runs through a rejected draft.  Memory (with provenance) proves what
  such an entry holds (the verification step computed it); the history says
  that draft was rejected.  A correct cache can always meet it: it registers
  by the accepted length, as vLLM's ``update_from_output`` does after its
  rollback (``num_computed_tokens -= num_rejected``, then ``cache_blocks``).

Coverage (:class:`SpecCoverage`), counted from the plans, the harness's own
record of each verification (``session.speculator``, the oracle's acceptance)
and memory-checked views, never from what the implementation says:

- ``verify_steps``: request steps that verified at least one draft;
  ``drafts_rejected_all`` / ``drafts_accepted_partial`` / ``drafts_accepted_all``:
  by how many of them the oracle accepted (none, some, all);
- ``zero_draft_after_accept``: a request's step without drafts right after
  its step that accepted drafts (vLLM#39273: only the speculative path reads
  the accepted column);
- ``drafts_across_block``: a verification whose positions (the last real
  token and the drafts) span two KV blocks, so a block boundary's state is
  one of the verified columns;
- ``hits_after_verify``: a new request's prefix hit that reuses a position an
  accepted draft took (KV a verification step wrote);
- ``snapshots_after_verify``: a state newly cached right after a verification
  step, after a number of tokens inside that step's accepted drafts (a column
  published at an accepted boundary);
- ``aborts_with_drafts``: an abort of a request with drafts proposed and not
  verified yet, or right after its verification step;
- ``verify_under_pressure``: a verification step in which the cache evicted
  (entries its memory-checked view stopped listing);
- ``verify_beside_chunked_prefill``: a verification step whose plan also
  carries another request's prefill chunk that does not finish its prompt.
"""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker

SPEC_COUNTERS = ("verify_steps", "drafts_rejected_all", "drafts_accepted_partial", "drafts_accepted_all",
                 "zero_draft_after_accept", "drafts_across_block", "hits_after_verify", "snapshots_after_verify",
                 "aborts_with_drafts", "verify_under_pressure", "verify_beside_chunked_prefill")


def _count(session, key: str, n: int = 1) -> None:
    session.coverage[key] = session.coverage.get(key, 0) + n


class SpecCoverage(Checker):
    name = "spec-coverage"

    def __init__(self):
        self.accepted_at: list[tuple[tuple[int, ...], int]] = []  # (base + first accepted draft, its position)
        self.just_verified: set[str] = set()  # requests whose latest step verified drafts
        self.evictions = 0

    def attached(self, session) -> None:
        if session.speculator.declared is not None:
            for key in SPEC_COUNTERS:
                session.coverage.setdefault(key, 0)

    def scheduled(self, session, plan, view) -> None:
        if session.probing or session.speculator.declared is None:
            return
        B = session.layout.block_size
        spec = session.speculator
        verifying = [rs for rs in plan.requests if rs.drafts]
        for rs in plan.requests:
            track = session.tracks[rs.request_id]
            if not rs.drafts and track.computed is not None and spec.previous_accepted.get(rs.request_id, 0) > 0:
                _count(session, "zero_draft_after_accept")
            if rs.drafts and (rs.end - 1) // B != (rs.end + len(rs.drafts) - 1) // B:
                _count(session, "drafts_across_block")
            if track.computed is None and rs.start > 0:
                prompt = track.tokens
                hit = any(rs.start > pos and prompt[: pos + 1] == prefix for prefix, pos in self.accepted_at)
                _count(session, "hits_after_verify", hit)
        if verifying:
            chunked = [rs for rs in plan.requests if not rs.drafts
                       and rs.start < session.tracks[rs.request_id].prompt_len
                       and rs.end < session.tracks[rs.request_id].prompt_len]
            _count(session, "verify_beside_chunked_prefill", bool(chunked))

    def stepped(self, session, record) -> None:
        if session.probing or session.speculator.declared is None:
            return
        done = session.speculator.last
        evicted = session.coverage.get("evictions", 0)
        if done:
            _count(session, "verify_under_pressure", evicted > self.evictions)
        self.evictions = evicted
        before = {e.tokens for e in record.view_before.cached_states} if record.view_before is not None else set()
        after = record.view_after.cached_states if record.view_after is not None else ()
        new_states = [e.tokens for e in after if e.tokens not in before]
        for rs in record.plan.requests:
            if rs.request_id not in done:
                self.just_verified.discard(rs.request_id)
        for v in done.values():
            self.just_verified.add(v.request_id)
            k, a = len(v.drafts), v.accepted
            _count(session, "verify_steps")
            _count(session, "drafts_rejected_all" if a == 0 else "drafts_accepted_all" if a == k
                   else "drafts_accepted_partial")
            if a:
                self.accepted_at.append((v.base + v.drafts[:1], v.end))
                tokens = v.base + v.drafts[:a]
                _count(session, "snapshots_after_verify",
                       sum(1 for t in new_states if v.end < len(t) <= v.end + a and t == tokens[: len(t)]))

    def aborted(self, session, request_id) -> None:
        if session.speculator.declared is None:
            return
        pending = request_id in session.speculator.proposals
        _count(session, "aborts_with_drafts", pending or request_id in self.just_verified)
        self.just_verified.discard(request_id)


class AcceptedPrefixOnly(Checker):
    """After a verification step nothing the cache lists as reusable runs
    through a rejected draft (see the module docstring)."""

    name = "accepted-prefix-only"

    def __init__(self):
        self.rejected: list[tuple[str, tuple[int, ...]]] = []  # (request, shortest prefix with a rejected draft)

    def stepped(self, session, record) -> None:
        spec = session.speculator
        for v in spec.last.values():
            r = v.rejected_prefix()
            if r is not None:
                self.rejected.append((v.request_id, r))
        if not self.rejected or record.view_after is None:
            return
        view, before = record.view_after, record.view_before
        known = ({("kv", e.block, e.tokens) for e in before.cached_kv}
                 | {("state", e.slot, e.tokens) for e in before.cached_states}) if before is not None else set()
        entries = [("kv", e.block, e.tokens) for e in view.cached_kv] + \
                  [("state", e.slot, e.tokens) for e in view.cached_states]
        for kind, ident, tokens in entries:
            if (kind, ident, tokens) in known:
                continue
            for rid, r in self.rejected:
                if len(tokens) >= len(r) and tokens[: len(r)] == r and not self._real(session, tokens):
                    what = f"KV block {ident}" if kind == "kv" else f"state slot {ident}"
                    raise ConformanceFailure(
                        "invariant", f"{what} is cached as reusable for a {len(tokens)}-token prefix that runs "
                                     f"through a draft of request {rid} the verifier rejected (position "
                                     f"{len(r) - 1}): memory holds what the verification step computed for it, "
                                     f"but only the accepted prefix may be reused")

    @staticmethod
    def _real(session, tokens) -> bool:
        """Whether some request's real sequence has this prefix after all."""
        n = len(tokens)
        return any(len(t.tokens) >= n and t.tokens[:n] == tokens for t in session.tracks.values())
