"""Checks of a declared retention policy, run after every step of a session.

An implementation may declare its policy with an optional ``retention()``
method (see ``contract.OPTIONAL_METHODS``)::

    {"interval": None | I, "admission": "always" | "second-hit",
     "prompt_ends": True | "tail" | "floor", "sequence_ends": bool,
     "hash_unit": u, "junctions": None | J, "interval_at": "anywhere" | "chunk-ends"}

From it the harness derives, per request, the *checkpoints*: the prompt end,
every multiple of I that is computed (of the block size when I is None; none
when I = 0) and, with ``sequence_ends``, the last computed position of a
request that finished.  Three rules describe engines that publish a state
only where a step ends (vLLM's Mamba "align" mode): ``prompt_ends = "tail"``
puts the prompt's checkpoint at its *tail*, the last multiple t of
``hash_unit`` before the last prompt token, and at the block boundary at or
before t (where the chunk before the tail ends; under ``"chunk-ends"``, only
where a step ends on it or exports it); ``prompt_ends = "floor"`` keeps that
block boundary but puts the tail at the last multiple of ``hash_unit`` at or
before the prompt's end, and only where that ends inside a block (vLLM 0.30
and 0.31; 0.32 on registers the tail one token earlier: see
conformance/adapters/vllm/compat.py); ``junctions = J`` adds
Marconi's shared-prefix junction: a new request whose prompt the cached KV
covers further than the hit it starts from has a checkpoint where that KV
coverage ends, rounded down to a multiple of J; and ``interval_at =
"chunk-ends"`` keeps a multiple of I (or of the block size) only where a step
ends on it or exports a state from inside the step (a snapshot of the plan:
vLLM's prefill checkpoint blocks); the default, ``"anywhere"``, keeps every
multiple computed.
A state that a load from a second tier brought in whole is admissible too.

A *sighting* is one request computing through a checkpoint (not reusing it),
once per request and position; under second-hit a prefix that some request
offered is a checkpoint for every later request that computes through it
(that is how a shared prefix gets its second sighting when it is not one of
the later request's own checkpoints).

Two families, reported apart because they are different kinds of bug:

- ``retention`` (a policy violation): a state cached at a position the policy
  never checkpoints (with I = 0 only prompt and sequence ends), or, under
  second-hit admission, a prefix admitted on its first sighting.
- ``hit-rate`` (a performance bug, logits stay right): a checkpoint the policy
  admits (always, or from the second sighting on) that is not cached right
  after the step that reached it, as far as the cache had room (a step that
  reaches more checkpoints than the state slots running requests and the
  step's own running slots and copy sources leave free, as the view states
  them (:func:`state_room`), is failed only for holding fewer than that; the
  message names the slots it counted), or a new request that reused less than the
  longest prefix whose KV and state the cache held when it was scheduled.
"""

from __future__ import annotations

from conformance.contract import CacheView
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker
from conformance.judge.reuse import INDEXES, LookupWindow, ViewIndex

FAMILIES = ("retention", "hit-rate")

# The pool probe's requests (``obs.probing``) are held to no declared
# policy, as they are counted in no coverage and no metric: they are the
# harness's instrument, not the check's workload.  Its steps are dry (nothing
# computed), its long request is sized to the whole KV pool (beyond the
# generator's budget, for which these rules' room is reasoned), and it runs
# after a sample of the examples, so a policy verdict there would depend on
# the sample.  What is certain on any cache still judges them: the contract,
# the memory invariants and the probe's own lifetime verdict.


def declared_retention(obs) -> dict | None:
    """The implementation's declared policy, validated; None if it declares none."""
    decl = obs.declared("retention")
    if decl is None:
        return None
    if not isinstance(decl, dict):
        raise ConformanceFailure("contract", f"retention() returned {type(decl).__name__}, not a dict")
    interval = decl.get("interval")
    admission = decl.get("admission", "always")
    if interval is not None and (not isinstance(interval, int) or interval < 0):
        raise ConformanceFailure("contract", f"retention(): interval must be None or an integer >= 0, got {interval!r}")
    if admission not in ("always", "second-hit"):
        raise ConformanceFailure("contract", f"retention(): unknown admission {admission!r}")
    prompt_ends = decl.get("prompt_ends", True)
    if prompt_ends not in (True, False, "tail", "floor"):
        raise ConformanceFailure("contract", f"retention(): prompt_ends must be true, false, \"tail\" or \"floor\", "
                                             f"got {prompt_ends!r}")
    units = {k: decl.get(k) for k in ("hash_unit", "junctions", "tier_unit")}
    for key, unit in units.items():
        if unit is not None and (not isinstance(unit, int) or isinstance(unit, bool) or unit < 1):
            raise ConformanceFailure("contract", f"retention(): {key} must be an integer >= 1, got {unit!r}")
    interval_at = decl.get("interval_at", "anywhere")
    if interval_at not in ("anywhere", "chunk-ends"):
        raise ConformanceFailure("contract", f"retention(): interval_at must be \"anywhere\" or \"chunk-ends\", "
                                             f"got {interval_at!r}")
    tier_over_local = decl.get("tier_over_local", True)
    if not isinstance(tier_over_local, bool):
        raise ConformanceFailure("contract", f"retention(): tier_over_local must be true or false, "
                                             f"got {tier_over_local!r}")
    return {"interval": interval, "admission": admission, "prompt_ends": prompt_ends,
            "tier_over_local": tier_over_local,
            "sequence_ends": bool(decl.get("sequence_ends", False)), "hash_unit": units["hash_unit"] or 1,
            "junctions": units["junctions"], "interval_at": interval_at, "tier_unit": units["tier_unit"]}


def state_room(view: CacheView | None, slots: int, busy: frozenset[int] = frozenset()) -> int:
    """The state slots a cache had for a step's checkpoints: those the view
    after the step states (``state_refcounts``) that no running request
    holds, free or holding a cached state it may replace, less ``busy``, the
    slots the step itself used otherwise (:func:`step_busy`).  Where one pool
    serves KV and states (vLLM), the view states a block for the state group
    only when the KV group does not own it (the vLLM adapter's ``owners``),
    so pages that running requests or cached entries hold as KV are no room
    for a state (a cache is not failed for keeping its cached KV rather than
    a checkpoint: a declared policy says nothing of which group an eviction
    takes).  Where every slot is stated (the reference: its own slot pool)
    this is ``slots`` less those held and those the step used.  A view that
    states no state refcounts tells nothing: ``slots`` less ``busy``."""
    return len(room_slots(view, slots, busy)) if view is not None and view.state_refcounts else slots - len(busy)


def room_slots(view: CacheView | None, slots: int, busy: frozenset[int] = frozenset()) -> list[int]:
    """The slots :func:`state_room` counts (empty where the view states no state refcounts)."""
    if view is None or not view.state_refcounts:
        return []
    cached = {e.slot for e in view.cached_states}
    running = sum(1 for s, r in view.state_refcounts.items() if r > 0 and s not in cached)
    unheld = sorted(s for s, r in view.state_refcounts.items() if 0 <= s < slots and (r <= 0 or s in cached)
                    and s not in busy)
    # never more than the layout leaves beside what running requests and the step hold
    return unheld[: max(0, slots - running - len(busy - {s for s, r in view.state_refcounts.items() if r > 0}))]


def step_busy(plan) -> frozenset[int]:
    """The slots a step used for something other than its checkpoints, which
    no cache could keep one in: every request's running slot (it runs the
    request to the step's end; handing a finishing request's slot over to the
    cache is a design some caches have, not a promise), the copy sources
    (``copy_from``: read at the step's start, a cached entry the step reuses)
    and both ends of the plan's state copies.  A snapshot target is room: a
    checkpoint went there."""
    busy = {rs.state_slot for rs in plan.requests}
    busy |= {rs.state_init.source for rs in plan.requests if rs.state_init.source is not None}
    busy |= {s for pair in plan.state_copies for s in pair}
    return frozenset(s for s in busy if s is not None)


class RetentionChecker(Checker):
    """Raises the failures of one family (``report``): ``retention`` (a state
    cached where the declared policy never keeps one) or ``hit-rate`` (less
    cached or reused than the policy promises)."""

    def __init__(self, report: str):
        if report not in FAMILIES:
            raise ValueError(f"unknown retention check {report!r}")
        super().__init__()
        self.name = report
        self.report = report
        self.decl: dict | None = None  # read from the implementation when attached
        self.B = 0
        self.sightings: dict[tuple[int, ...], int] = {}
        self.admissible: set[tuple[int, ...]] = set()  # prefixes the policy allowed to be cached
        self.offered: dict[str, set[int]] = {}  # request -> positions it offered
        self.window = LookupWindow()
        self.recorded: dict[tuple[int, ...], int] = {}  # prefix -> step in which it was first offered
        self.step_no = 0
        self.junctions: dict[str, int] = {}  # request -> its shared-prefix junction (0: none)

    # -- the declared checkpoints ---------------------------------------------------
    def checkpoints(self, start: int, end: int, prompt_len: int, exported: frozenset[int] = frozenset()) -> list[int]:
        """The declared checkpoints a step over [start, end) reaches.  Under
        ``interval_at = "chunk-ends"`` a state is published where the step
        ends or where it exports one from inside (a snapshot: vLLM's prefill
        checkpoint blocks), never elsewhere."""
        assert self.decl is not None  # asked only of a checker whose implementation declared one
        interval = self.decl["interval"]
        step = self.B if interval is None else interval
        published = {end} | set(exported)
        if self.decl["prompt_ends"] in ("tail", "floor"):
            h = self.decl["hash_unit"]
            # the block boundary before the tail: where the chunk before the
            # tail ends, unless the tail is exported from inside one chunk
            floor = (prompt_len - 1) // h * h // self.B * self.B
            if self.decl["prompt_ends"] == "tail":
                tails = {(prompt_len - 1) // h * h}
            else:  # the prompt's end floored to h, where it ends inside a block
                tails = {prompt_len // h * h} - {q for q in (prompt_len // h * h,) if q % self.B == 0}
            ends = tails | ({floor} if self.decl["interval_at"] != "chunk-ends" or floor in published else set())
        else:
            ends = {prompt_len} if self.decl["prompt_ends"] else set()
        out = {q for q in ends if start < q <= end}
        if step > 0 and self.decl["interval_at"] == "chunk-ends":
            out.update(q for q in published if start < q <= end and q % step == 0)
        elif step > 0:
            out.update(range((start // step + 1) * step, end + 1, step))
        return sorted(q for q in out if q > 0)

    # -- checker --------------------------------------------------------------------
    def load(self, obs) -> None:
        """Read (and validate) the implementation's declared policy."""
        self.decl = declared_retention(obs)
        self.B = obs.layout.block_size
        declared = obs.speculation  # a drafter's hit drop (EAGLE / MTP) shortens every reuse
        self.window.hit_drop = declared.hit_drop if declared is not None else 0

    def attached(self, obs) -> None:
        self.load(obs)

    def stepped(self, obs, record) -> None:
        if self.decl is None or obs.probing:  # the pool probe's requests: see FAMILIES
            return
        plan, view_before, finished = record.plan, record.view_before, record.finished
        now = INDEXES.get(obs.last_view, self.B)
        if self.report == "hit-rate":
            self._check_lookups(obs, plan, view_before)
        offered: list[tuple[str, int, tuple[int, ...]]] = []
        self.step_no += 1
        verified = obs.history.verified_this_step()
        for i, rs in enumerate(plan.requests):
            track = obs.tracks[rs.request_id]
            # a verification step reaches through its accepted drafts, and holds
            # the state of each accepted position in a column of its own
            v = verified.get(rs.request_id)
            reach = rs.end + (v.accepted if v is not None else 0)
            exported = {q for q, _ in rs.snapshots} | set(range(rs.end, reach + 1))
            qs = self.checkpoints(rs.start, reach, track.prompt_len, frozenset(exported))
            if self.decl["junctions"]:
                qs += self._junction(obs, view_before, track, rs, plan.requests[i + 1:])
            if self.decl["admission"] == "second-hit":
                qs += self._sighted(track.tokens, rs.start, reach)
            if rs.request_id in finished and self.decl["sequence_ends"]:
                qs.append(track.computed)
            mine = self.offered.setdefault(rs.request_id, set())
            for q in qs:
                if q not in mine:
                    mine.add(q)
                    prefix = track.tokens[:q]
                    self.sightings[prefix] = self.sightings.get(prefix, 0) + 1
                    self.recorded.setdefault(prefix, self.step_no)
                    offered.append((rs.request_id, q, prefix))
        cov = self.coverage
        wanted: dict[tuple[int, ...], tuple[str, int, int]] = {}  # admitted checkpoints of this step
        for rid, q, prefix in offered:
            n = self.sightings[prefix]  # after the whole step: two requests may sight it together
            cov["checkpoints_offered"] = cov.get("checkpoints_offered", 0) + 1
            admit = self.decl["admission"] == "always" or n >= 2
            key = "first_sightings" if n == 1 else "repeat_sightings"
            cov[key] = cov.get(key, 0) + 1
            if admit:
                # the situation the admission rule is about: a checkpoint it
                # lets in (under second-hit, exactly the repeat sightings)
                cov["admissions"] = cov.get("admissions", 0) + 1
                self.admissible.add(prefix)
            if not admit and prefix in now.states:
                self._fail("retention", f"request {rid}: the state after {q} tokens was admitted on its first "
                                        f"sighting, but the declared admission is second-hit")
            if admit:
                wanted.setdefault(prefix, (rid, q, n))
        self._check_capacity(obs, wanted, now, step_busy(plan))
        # A state loaded from the second tier may be cached: the tier kept it
        # (the harness's own record of what loads brought in, not the view).
        loaded = obs.loaded_states
        before = INDEXES.get(view_before, self.B)
        for prefix in now.states - before.states:
            if prefix not in self.admissible and prefix not in loaded:
                self._fail("retention", f"a state after {len(prefix)} tokens was cached, a position the declared "
                                        f"policy {self._policy()} never checkpoints (or has not admitted yet)")

    def _check_capacity(self, obs, wanted: dict, now, busy: frozenset[int] = frozenset()) -> None:
        """Every checkpoint the policy admits is cached right after the step
        that reached it, as far as the cache had room: a step that reaches
        more checkpoints than there are state slots neither held by running
        requests nor used by the step otherwise (:func:`state_room`,
        :func:`step_busy`) is failed only for holding fewer than that."""
        assert self.decl is not None  # asked only of a checker whose implementation declared one
        missing = [(p, info) for p, info in wanted.items() if p not in now.states]
        if not missing:
            return
        slots = obs.layout.num_state_slots
        room = state_room(obs.last_view, slots, busy)
        held = len(wanted) - len(missing)
        if held >= min(len(wanted), room):
            self.count("checkpoints_beyond_capacity", len(missing))
            return
        _prefix, (rid, q, n) = missing[0]
        why = "reached" if self.decl["admission"] == "always" else f"sighted {n} times"
        listed = room_slots(obs.last_view, slots, busy)
        where = (f"state slots {', '.join(map(str, listed))}, free or caching a state after the step"
                 if listed else f"{slots} state slots in the layout (the view states no refcounts)")
        used = f"; not room: the step's running slots and copy sources {', '.join(map(str, sorted(busy)))}" \
            if busy else ""
        self._fail("hit-rate", f"request {rid}: checkpoint at position {q} ({why}) is not cached after the step, "
                               f"though the declared policy {self._policy()} keeps it: the step reached "
                               f"{len(wanted)} admitted checkpoints and held {held}, with room for {room} "
                               f"({where}{used})")

    def _junction(self, obs, view_before, track, rs, later=()) -> list[int]:
        """The request's junction: where the KV that other requests had cached
        when it was first scheduled (``plan_view``: an engine may register a
        request's blocks as it schedules them, so a request scheduled before
        it in the same step counts; one scheduled after it, ``later`` in the
        plan, does not: nothing could have seen its KV yet, and vLLM 0.30/0.31
        schedule two cold copies of one prefix in one step) stops covering its
        prompt, rounded down to the junction unit; a checkpoint when a step
        reaches it past the hit."""
        assert self.decl is not None  # asked only of a checker whose implementation declared one
        rid = rs.request_id
        if track.steps == 1:
            # its own blocks: those past the hit that no one had cached before,
            # and those of requests scheduled after it in this step
            before = {e.block for e in view_before.cached_kv} if view_before is not None else set()
            own = set(rs.block_table[rs.start // self.B:]) - before
            for other in later:
                own |= set(other.block_table[other.start // self.B:]) - before
            others = CacheView(cached_kv=tuple(e for e in obs.plan_view.cached_kv if e.block not in own))
            covered = ViewIndex.of(others, self.B).kv_servable(track.tokens[: track.prompt_len])
            unit = self.decl["junctions"]
            self.junctions[rid] = covered // unit * unit if covered > rs.start else 0
        q = self.junctions.get(rid, 0)
        return [q] if rs.start < q <= rs.end else []

    def _sighted(self, tokens, start: int, end: int) -> list[int]:
        """Under second-hit, a prefix some request offered is a checkpoint for
        every request computing through it: one offered before this step
        anywhere in the chunk, or earlier in this step at the chunk's end."""
        out = []
        for q in range(start + 1, end + 1):
            at = self.recorded.get(tokens[:q])
            if at is not None and (at < self.step_no or q == end):
                out.append(q)
        return out

    def _check_lookups(self, obs, plan, view_before) -> None:
        """A new request reuses the longest prefix whose KV and state the cache
        held at every schedule() since it was submitted (see LookupWindow)."""
        # (an implementation that lists no KV in its view is never held to a
        # reuse: without KV, nothing is servable)
        for rid, (_kv, best) in self.window.observe(obs, plan, view_before).items():
            rs = next(r for r in plan.requests if r.request_id == rid)
            self.count("state_lookups")
            if rs.start < best:
                self._fail("hit-rate", f"request {rid} reused {rs.start} tokens, but the cache held the KV and the "
                                       f"state of its first {best} tokens at every schedule() since it was submitted")

    def _policy(self) -> str:
        assert self.decl is not None  # asked only of a checker whose implementation declared one
        i = self.decl["interval"]
        return f"(interval={'block' if i is None else i}, admission={self.decl['admission']})"

    def _fail(self, kind: str, message: str) -> None:
        if kind == self.report:
            raise ConformanceFailure(kind, message)
