"""The view taken right after ``schedule()``, judged where it lists as
reusable what the step is about to write (issue 37, item 2).

A cache may list content at ``schedule()`` that the step then computes:
vLLM's ``allocate_slots`` caches the full blocks of the tokens it schedules
before the forward pass, so a request admitted later in the same
``schedule()`` can hit them.  That listing is a promise about the step, and
another request of the same schedule may already have taken it; so each
entry of that view whose positions (KV) or slot (a state) a request step of
the plan writes is held to it once the step ran:

- it must not run through a draft the verifier did not keep: a listing made
  before the verifier decided is a hit on content that was never the
  sequence's (vllm#47930's family: draft KV shareable before acceptance);
  a correct cache lists a verification's positions by the accepted length
  only, after ``update()``, or, at ``schedule()``, the known tokens only;
- memory must then hold what it listed (the step wrote that content there).

The view after ``update()`` is judged whole by the view checker and the
accepted-prefix rule; entries of the view after ``schedule()`` that the step
does not write are judged there too, once the step is over (a listing that
only this view made and the next one dropped is left unjudged: the harness
cannot tell a listing that no request could take from one that one did).
"""

from __future__ import annotations

from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker

Prefix = tuple[int, ...]


class PlanViewListings(Checker):
    name = "plan-view-listings"

    def __init__(self):
        super().__init__()
        self.pending: list[tuple[str, int, Prefix]] = []  # (kind, block or slot, tokens) listed and written

    def scheduled(self, obs, ev):
        self.pending = []
        view, plan = ev.view, ev.plan
        if view is None or obs.probing or not plan.requests or not (view.cached_kv or view.cached_states):
            return
        B = obs.layout.block_size
        written: set[tuple[int, int]] = set()
        slots: set[int] = set()
        for rs in plan.requests:
            table = rs.block_table
            for pos in range(rs.start, min(rs.end + len(rs.drafts), len(table) * B)):
                written.add((table[pos // B], pos % B))
            slots.add(rs.state_slot)
            slots.update(rs.draft_slots)
            slots.update(s for _, s in rs.snapshots)
        for e in view.cached_kv:
            n = len(e.tokens)
            if n and any((e.block, off) in written for off in range((n - 1) % B + 1)):
                self.pending.append(("kv", e.block, e.tokens))
        for s in view.cached_states:
            if s.slot in slots:
                self.pending.append(("state", s.slot, s.tokens))

    def stepped(self, obs, record):
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        rejected = [(v.request_id, r) for v in obs.history.verified_this_step().values()
                    if (r := v.rejected_prefix()) is not None]
        mem, B = obs.memory, obs.layout.block_size
        for kind, ident, tokens in pending:
            what = f"KV block {ident}" if kind == "kv" else f"state slot {ident}"
            for rid, r in rejected:
                if tokens[: len(r)] == r and not _real(obs, tokens):
                    raise ConformanceFailure(
                        "invariant", f"{what} was listed as reusable for a {len(tokens)}-token prefix in the view "
                                     f"right after schedule(), before the step verified the drafts it runs "
                                     f"through, and the verifier did not keep request {rid}'s draft at position "
                                     f"{len(r) - 1}: a request of that schedule could take content that was "
                                     f"never the sequence's (list a verification's positions by the accepted "
                                     f"length, after update())")
            if kind == "kv":
                n = len(tokens)
                held = all(mem.kv_prov[ident][pos % B] == tokens[: pos + 1] for pos in range((n - 1) // B * B, n))
            else:
                held = mem.state_holds(ident) == (tokens, tokens)
            if not held:
                raise ConformanceFailure(
                    "invariant", f"{what} was listed as reusable for a {len(tokens)}-token prefix in the view right "
                                 f"after schedule(), and the step that wrote it did not leave that content there")


def _real(obs, tokens: Prefix) -> bool:
    """Whether some request's real sequence has this prefix after all."""
    n = len(tokens)
    return any(len(t.tokens) >= n and t.tokens[:n] == tokens for t in obs.tracks.values())
