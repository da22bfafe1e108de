"""Coverage: counters of the situations a run reached.  A check requires some
of them to end above zero (a check whose situation never occurred proves
nothing).  Counted from what the session records, never from what the
implementation says about itself, except evictions, which are what its view
stopped listing (memory proved the view honest; the session measures them,
``Observation.evicted``).  The pool probe's requests (``obs.probing``) are
not counted: they are the harness's, not the check's.

Counters whose names promise an order or a cause count exactly that:

- ``hits_after_eviction``: a prefix hit (a new request's first step starts
  past 0) in a session whose cache had already evicted an entry before that
  step -- reuse that survived pressure, not a hit and an eviction anywhere;
- ``tier_hits``: a prefix hit whose step read bytes a tier load landed (a
  KV block or the state slot of the hit, by the load's id in memory, copies
  included) -- a hit served by the second tier, not any load and any hit;
- ``tier_recoveries``: the first step of a request a load of which came back
  failed or with bytes other than its entry's (the record's
  ``TransferCompleted.intact``, which the transport sets):
  the request went on after the tier failed it (the logits judged how).
  What environment faults leave of ``tier_hits`` where they break most loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conformance.harness.checker import Checker
from conformance.harness.history import TransferCompleted

# Counters every run reports; checkers of other concerns add their own.
COUNTERS = ("steps", "requests", "prefix_hits", "mid_block_hits", "snapshot_reuse", "multi_turn_hits",
            "chunked_prefills", "mid_block_chunk_ends", "evictions", "decode_steps", "aborts",
            "tier_offloads", "tier_loads",  # transfers to and from the host tier that completed ok
            "hits_after_eviction", "tier_hits")


class CoverageCounter(Checker):
    name = "coverage"

    def __init__(self):
        super().__init__()
        self._seen = 0  # events of the record read for broken loads
        self._broken: set = set()

    def attached(self, obs):
        for key in COUNTERS:
            self.coverage.setdefault(key, 0)

    def submitted(self, obs, ev):
        if not obs.probing:  # the pool probe's requests are not the situations a check asks for
            self.count("requests")

    def aborted(self, obs, ev):
        self.count("aborts")

    def scheduled(self, obs, ev):
        if obs.probing:
            return
        self.coverage["steps"] = obs.step_no
        B = obs.layout.block_size
        for rs in ev.plan.requests:
            track = obs.tracks[rs.request_id]
            first = track.computed is None
            if first and rs.start > 0:
                self.count("prefix_hits")
                self.count("mid_block_hits", rs.start % B != 0)
                if track.continues is not None:
                    self.count("multi_turn_hits")
                self.count("hits_after_eviction", obs.evicted > 0)
            if rs.state_init.kind != "fresh" and rs.start > 0 and first:
                # copied, or resumed from a running slot the plan's state copies (or a load) filled:
                # either way a cached state served the hit (a cache's way of taking it is its design)
                self.count("snapshot_reuse")
            if rs.end < track.prompt_len:
                self.count("chunked_prefills", first)
                self.count("mid_block_chunk_ends", rs.end % B != 0)
            if rs.start >= track.prompt_len:
                self.count("decode_steps")

    def computed(self, obs, executed):
        rs = executed.step
        if not obs.probing and obs.tracks[rs.request_id].computed is None:
            if rs.start > 0:
                self.count("tier_hits", bool(executed.loads_read))
            if rs.request_id in self._broken_loads(obs):  # (counted only there: most runs move nothing)
                self.count("tier_recoveries")

    def _broken_loads(self, obs) -> set:
        """Requests a load of which completed failed or not intact (from the record)."""
        for ev in obs.history.since(self._seen):
            if isinstance(ev, TransferCompleted) and (not ev.ok or ev.intact is False):
                t = obs.history.issued(ev.id)
                if t is not None and t.direction == "load":
                    self._broken.add(t.request_id)
        self._seen = len(obs.history.events)
        return self._broken

    def settled(self, obs, ev):
        done = obs.transfers_succeeded
        self.coverage["tier_offloads"], self.coverage["tier_loads"] = done["offload"], done["load"]
        # the session's measure (entries its views stopped listing, outside the probe)
        self.coverage["evictions"] = obs.evicted


# -- coverage a correct design may never produce ------------------------------------------
#
# A check requires its situations to occur (a check that exercised nothing
# proves nothing), but some situations are a design's choice, not the
# generator's: a cache that evicts a recurrent state together with the KV
# before it never lets a state outlive that KV; a cache that reuses whole
# blocks never hits inside one.  Such a cache is correct, and red for its
# design would be a false verdict.  Each counter below is excused in one
# way, and only that one:
#
# - **declared**: the cache says so in ``retention()`` (``tier_over_local``),
#   where not producing the situation would otherwise be a broken promise
#   that another judge holds it to (the expected-hit oracle expects a host
#   tier to beat a local hit unless declared not to);
# - **observed**: memory shows the design had its chances and never took
#   them (``chances``, a counter of the same checkers, at least ``at_least``
#   times), where the choice is the cache's alone (which entry it evicts
#   first, where it ends a chunk): the run passes with a note saying what
#   was not exercised.  The chances are counted from memory and the
#   harness's record, as every counter is: a generator that stopped building
#   the history leaves them at 0 too, and the check still fails.
#
# ``needs``: a situation built on another (an abort inside a block copied by
# a mid-block hit needs the hit); excused with it, never alone.  ``given``:
# an observation holds only where these occurred (whole blocks only is a
# design of reuse: a cache that never reused is no such design).  Where the
# chances fell short the coverage failure says how many there were.
#
# A third way is the check's pool (or block size): a counter it cannot hold
# (two requests at once in a pool the generator's budget gives one at a
# time) is excused by :func:`conformance.generate.budget.pool_limits`, said
# before the run's first check (``pool`` below).


@dataclass(frozen=True)
class DesignWaiver:
    counter: str
    design: str  # the design that never produces it, and what then goes unchecked
    declared: Callable[[dict], bool] | None = None  # retention() rules it out
    contradicted: str = ""  # the note when the counter is above 0 under such a declaration
    chances: str = ""  # observed: the counter of the design's chances
    at_least: int = 0
    needs: tuple[str, ...] = ()
    given: tuple[str, ...] = ()  # observed only where these occurred (a design of reuse: it reused)


# How many chances make an observation: enough that a cache of the other
# design would have taken one (the reference takes most of its chances).
OBSERVED_CHANCES = 5

WAIVERS: tuple[DesignWaiver, ...] = (
    DesignWaiver(
        "tier_hits_over_local",
        "the implementation declares tier_over_local=False: a host-tier hit over a local one was not asked for, "
        "and its reconciliation was not checked",
        declared=lambda d: d.get("tier_over_local") is False,
        contradicted="the implementation declares tier_over_local=False, yet {n} hits read host-tier loads past a "
                     "local hit (memory's load ids): the declaration does not hold"),
    # A tier with no path for a lost load (declared: vLLM's OffloadingConnector,
    # whose worker asserts every job succeeded) has its loads decided in time only
    # (generate/rules/transfers.py): no host entry is evicted under a load.
    DesignWaiver(
        "store_evicted_during_load",
        "the implementation declares tier_losses=False (its tier has no path for a lost load): loads were decided "
        "in time only (late, out of order), none failed, short or evicted under the load; --faults injects those "
        "against its recorded limitation",
        declared=lambda d: d.get("tier_losses") is False,
        contradicted="the implementation declares tier_losses=False, yet {n} loads met a store eviction (under "
                     "--faults, or the declaration does not hold)"),
    DesignWaiver(
        "state_outlives_kv",
        "{chances} times memory lost KV below a state this cache had cached, and each time the state was gone by "
        "then: a design in which a recurrent state never outlives the KV before it (SGLang's radix tree evicts a "
        "node's state with its KV); a hit past the KV memory holds (vllm#46453) was not exercised",
        chances="states_gone_with_kv", at_least=OBSERVED_CHANCES),
    DesignWaiver(
        "mid_block_hits",
        "{chances} prompts arrived while memory held the KV and a state of a prefix of theirs ending inside a "
        "block, and no hit ended inside a block: a design that reuses whole blocks only (vLLM's default match "
        "unit, SGLang's pages); a hit ending inside a block (its copy-on-write) was not exercised",
        chances="mid_block_reuse_held", at_least=OBSERVED_CHANCES, given=("prefix_hits",)),
    DesignWaiver(
        "mid_block_chunk_ends",
        "{chances} prefill chunks ended before their prompt's end, each on a block boundary: a design that cuts "
        "chunks at block boundaries only (SGLang's pages); a chunk ending inside a block was not exercised",
        chances="chunked_prefills", at_least=OBSERVED_CHANCES),
    DesignWaiver(
        "short_chunks_from_snapshot",
        "{chances} first steps from a cached state were asked for fewer tokens than the conv window and computed "
        "more: a design that rounds a chunk up to a page (SGLang's pages of 4); a chunk shorter than the conv "
        "window from a snapshot (vllm#56196) was not exercised",
        chances="short_chunks_rounded_up", at_least=OBSERVED_CHANCES),
    DesignWaiver(
        "snapshot_hits_under_slot_pressure",
        "{chances} hits reused a cached state under views that state no state refcounts (optional in the "
        "contract): a free slot cannot be told from a held one there, and slot pressure at a hit was not measured",
        chances="snapshot_hits_unmeasured", at_least=OBSERVED_CHANCES),
    # (issue 37, h) a design whose hit's first chunk runs to the end of the block it copied, whatever
    # the budget: its copy is incomplete only before that chunk, where the abort-copy rule's third hit
    # aborts it (reach_coverage), and that chunk never stops inside the block
    DesignWaiver("aborts_before_copied_block_complete", "an abort before a mid-block hit's copied block is complete "
                 "needs such a hit; where a hit's first chunk runs to the end of the block it copied (a design), "
                 "the copy is incomplete only before that chunk, and aborts there were exercised "
                 "(aborts_after_copy_before_first_step)", needs=("mid_block_hits",),
                 chances="aborts_after_copy_before_first_step", at_least=1),
    DesignWaiver("mid_block_chunks_after_mid_block_hit", "a chunk ending inside a block after a mid-block hit "
                 "needs both; a first chunk after a mid-block hit that stops before the prompt's end stopped at the "
                 "block's end every time (hit_chunks_to_block_end): a design that runs it to the block's end, "
                 "where a second stop inside the block (vllm#51763) was not exercised",
                 needs=("mid_block_hits", "mid_block_chunk_ends"), chances="hit_chunks_to_block_end",
                 at_least=OBSERVED_CHANCES),
    DesignWaiver(
        "snapshots_after_verify",
        "the declared policy keeps no state a decode step reaches (interval 0, no sequence ends; prompt ends and "
        "junctions lie in prompts): a state cached inside accepted drafts was not asked for",
        declared=lambda d: d.get("interval") == 0 and not d.get("sequence_ends"),
        contradicted="the declared policy keeps no state a decode step reaches, yet {n} states were cached inside "
                     "accepted drafts"),
)


def design_waivers(required: tuple[str, ...], coverage: dict[str, int], declared: object,
                   pool: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The required counters at 0 that the cache's design (declared or
    observed, :data:`WAIVERS`) or the check's pool (``pool``: counter -> why)
    excuses, each with the note its result carries; and the notes of
    declarations that memory contradicts.  A counter above 0 is never
    excused: it is asked for, and it occurred."""
    by_counter = {w.counter: w for w in WAIVERS}
    decl = declared if isinstance(declared, dict) else {}
    excused: dict[str, str] = {}
    notes: list[str] = []
    # the situations a required one is built on are weighed too, required or not
    weighed = [*required, *(x for c in required if c in by_counter for x in by_counter[c].needs if x not in required)]
    for c in weighed:
        n = coverage.get(c, 0)
        w = by_counter.get(c)
        if w is not None and w.declared is not None and w.declared(decl):
            if n:
                notes.append(w.contradicted.format(n=n))
            else:
                excused[c] = w.design
        elif n:
            continue
        elif pool and c in pool:
            excused[c] = pool[c]
        elif w is not None and w.chances and coverage.get(w.chances, 0) >= w.at_least \
                and all(coverage.get(g, 0) for g in w.given):
            excused[c] = f"{c} stayed at 0, observed: " + w.design.format(chances=coverage[w.chances])
    for c in required:  # a situation built on an excused one goes with it
        w = by_counter.get(c)
        if c not in excused and not coverage.get(c, 0) and w is not None and w.needs \
                and any(x in excused for x in w.needs):
            why = "; ".join(excused[x] if x not in required else f"{x} was excused above"
                            for x in w.needs if x in excused)
            excused[c] = f"{c} stayed at 0: {w.design} ({why})"
    excused = {c: why for c, why in excused.items() if c in required}
    return excused, notes


def chances_short(required: tuple[str, ...], coverage: dict[str, int], excused: dict[str, str]) -> list[str]:
    """For a coverage failure: the counters a design could have excused by
    observation, with the chances the run had (too few to say)."""
    out = []
    for w in WAIVERS:
        if w.counter in required and w.chances and w.counter not in excused and not coverage.get(w.counter, 0):
            out.append(f"{w.counter} is excused for a design that never produces it after {w.at_least} chances "
                       f"({w.chances}); this run had {coverage.get(w.chances, 0)}")
    return out
