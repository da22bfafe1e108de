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
record of each verification (the history's ``Verified`` events: the oracle's acceptance)
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
from conformance.harness.history import DraftsProposed

SPEC_COUNTERS = ("verify_steps", "drafts_rejected_all", "drafts_accepted_partial", "drafts_accepted_all",
                 "zero_draft_after_accept", "drafts_across_block", "hits_after_verify", "snapshots_after_verify",
                 "aborts_with_drafts", "verify_under_pressure", "verify_beside_chunked_prefill")


class SpecCoverage(Checker):
    name = "spec-coverage"

    def __init__(self):
        super().__init__()
        self.accepted_at: list[tuple[tuple[int, ...], int]] = []  # (base + first accepted draft, its position)
        self.just_verified: set[str] = set()  # requests whose latest step verified drafts
        self.last_accepted: dict[str, int] = {}  # request -> drafts its latest step accepted
        self.pending: set[str] = set()  # requests with drafts proposed and not verified yet
        self.seen = 0  # history events folded so far
        self.evicted = 0

    def _fold(self, obs) -> None:
        for ev in obs.history.since(self.seen):
            if isinstance(ev, DraftsProposed):
                (self.pending.add if ev.tokens else self.pending.discard)(ev.request_id)
        self.seen = len(obs.history.events)

    def attached(self, obs) -> None:
        if obs.speculation is not None:
            for key in SPEC_COUNTERS:
                self.coverage.setdefault(key, 0)

    def scheduled(self, obs, ev) -> None:
        if obs.probing or obs.speculation is None:
            return
        self._fold(obs)
        plan, B = ev.plan, obs.layout.block_size
        verifying = [rs for rs in plan.requests if rs.drafts]
        for rs in plan.requests:
            track = obs.tracks[rs.request_id]
            if not rs.drafts and track.computed is not None and self.last_accepted.get(rs.request_id, 0) > 0:
                self.count("zero_draft_after_accept")
            if rs.drafts and (rs.end - 1) // B != (rs.end + len(rs.drafts) - 1) // B:
                self.count("drafts_across_block")
            if track.computed is None and rs.start > 0:
                prompt = track.tokens
                self.count("hits_after_verify", any(rs.start > pos and prompt[: pos + 1] == prefix
                                                    for prefix, pos in self.accepted_at))
        if verifying:
            chunked = [rs for rs in plan.requests if not rs.drafts
                       and rs.start < obs.tracks[rs.request_id].prompt_len
                       and rs.end < obs.tracks[rs.request_id].prompt_len]
            self.count("verify_beside_chunked_prefill", bool(chunked))

    def computed(self, obs, executed) -> None:
        if obs.speculation is not None:
            self._fold(obs)
            self.pending.discard(executed.step.request_id)  # a proposal lasts until the request's next step

    def stepped(self, obs, record) -> None:
        if obs.probing or obs.speculation is None:
            return
        done = obs.history.verified_this_step()
        if done:
            self.count("verify_under_pressure", obs.evicted > self.evicted)
        self.evicted = obs.evicted
        before = {e.tokens for e in record.view_before.cached_states} if record.view_before is not None else set()
        after = record.view_after.cached_states if record.view_after is not None else ()
        new_states = [e.tokens for e in after if e.tokens not in before]
        for rs in record.plan.requests:
            v = done.get(rs.request_id)
            self.last_accepted[rs.request_id] = v.accepted if v is not None else 0
            if v is None:
                self.just_verified.discard(rs.request_id)
        for v in done.values():
            self.just_verified.add(v.request_id)
            k, a = len(v.drafts), v.accepted
            self.count("verify_steps")
            self.count("drafts_rejected_all" if a == 0 else "drafts_accepted_all" if a == k
                       else "drafts_accepted_partial")
            if a:
                self.accepted_at.append((v.base + v.drafts[:1], v.end))
                tokens = v.base + v.drafts[:a]
                self.count("snapshots_after_verify",
                           sum(1 for t in new_states if v.end < len(t) <= v.end + a and t == tokens[: len(t)]))

    def aborted(self, obs, ev) -> None:
        if obs.speculation is None:
            return
        self._fold(obs)
        rid = ev.request_id
        self.count("aborts_with_drafts", rid in self.pending or rid in self.just_verified)
        self.pending.discard(rid)
        self.just_verified.discard(rid)


class AcceptedPrefixOnly(Checker):
    """After a verification step nothing the cache lists as reusable runs
    through a rejected draft (see the module docstring)."""

    name = "accepted-prefix-only"

    def __init__(self):
        super().__init__()
        self.rejected: list[tuple[str, tuple[int, ...]]] = []  # (request, shortest prefix with a rejected draft)

    def stepped(self, obs, record) -> None:
        for v in obs.history.verified_this_step().values():
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
                if len(tokens) >= len(r) and tokens[: len(r)] == r and not self._real(obs, tokens):
                    what = f"KV block {ident}" if kind == "kv" else f"state slot {ident}"
                    raise ConformanceFailure(
                        "invariant", f"{what} is cached as reusable for a {len(tokens)}-token prefix that runs "
                                     f"through a draft of request {rid} the verifier rejected (position "
                                     f"{len(r) - 1}): memory holds what the verification step computed for it, "
                                     f"but only the accepted prefix may be reused")

    @staticmethod
    def _real(obs, tokens) -> bool:
        """Whether some request's real sequence has this prefix after all."""
        n = len(tokens)
        return any(len(t.tokens) >= n and t.tokens[:n] == tokens for t in obs.tracks.values())
