"""Structural invariants: the implementation's stated bookkeeping against
what the harness's memory really holds."""

from __future__ import annotations

from conformance.contract import NULL_BLOCK, CacheView, RequestStep, StepPlan
from conformance.errors import ConformanceFailure
from conformance.harness.checker import Checker
from conformance.harness.memory import Memory
from conformance.harness.transport import HostStore

# What a stated refcount means (contract.CacheView): the number of holders
# other than the cache itself -- requests, and copies or transfers of a step
# not yet run.  An entry that is only cached (reusable, evictable) sits at 0
# like a free one; so at idle (no request active, no transfer in flight) every
# refcount is 0, and one above 0 is held by nothing that can let it go.
NO_KV_REFCOUNTS = ("the implementation states no KV refcounts: 'blocks in use are held' was not checked, and "
                   "leaks are judged by the pool probe alone")
NO_STATE_REFCOUNTS = "the implementation states no state-slot refcounts: slot leaks are judged by the pool probe alone"
NO_HOST_LISTING = ("the implementation's tier offloaded but its view lists no host entries: what the tier holds was "
                   "judged only where a load brought it back")


def check_view(view: CacheView, memory: Memory, idle: bool) -> list[str]:
    """Violations, as sentences.  ``idle``: no request is active and no
    transfer is in flight (see the refcount rule above)."""
    problems = []
    lay = memory.layout
    B = lay.block_size
    for name, counts, limit in (("KV block", view.kv_refcounts, lay.num_kv_blocks),
                                ("state slot", view.state_refcounts, lay.num_state_slots)):
        for ident, n in counts.items():
            if not 0 <= ident < limit:
                problems.append(f"{name} {ident} is outside the layout (capacity {limit})")
            if n < 0:
                problems.append(f"{name} {ident} has refcount {n}")
            if idle and n > 0:
                problems.append(f"{name} {ident} leaked: refcount {n} at idle (a refcount counts requests and "
                                f"pending copies or transfers, never the cache's own retention)")
    for entry in view.cached_kv:
        group = entry.window_group
        if group is not None and not 0 <= group < len(memory.windows):
            problems.append(f"KV block {entry.block} is cached for window group {group}, but the model has "
                            f"{len(memory.windows)} window groups")
            continue
        rows = memory.prov_rows(group)
        what = "" if group is None else f" (window group {group})"
        first = (len(entry.tokens) - 1) // B * B
        for pos in range(first, len(entry.tokens)):
            held = rows[entry.block][pos % B] if 0 <= entry.block < lay.num_kv_blocks else None
            if held != entry.tokens[: pos + 1]:
                problems.append(f"KV block {entry.block}{what} is cached for a {len(entry.tokens)}-token prefix but "
                                f"position {pos} holds {_what(held, entry.tokens[: pos + 1])}")
                break
    for state in view.cached_states:
        if not 0 <= state.slot < lay.num_state_slots:
            problems.append(f"cached state slot {state.slot} is outside the layout")
            continue
        conv, ssm = memory.state_holds(state.slot)
        for part, held in (("conv", conv), ("matrix", ssm)):
            if held != state.tokens:
                problems.append(f"state slot {state.slot} is registered as the state after {len(state.tokens)} "
                                f"tokens but its {part} state is {_what(held, state.tokens)}")
    return problems


def check_host_view(view: CacheView, store: HostStore, block_size: int, judged: dict | None = None) -> list[str]:
    """Violations of the host tier's listings (``view.host_cached``) against
    what the harness's store holds, as sentences.  Not judged: a listed key
    the store no longer holds (an environment fault dropped it: the
    implementation learns it when it loads), and an entry whose bytes are not
    the source bytes (cut short or corrupted on the wire: ``intact`` False;
    only a verifying load can tell, and rejects it).  ``judged``: entries found
    right before, by key (an entry at rest does not change; a new offload puts
    a new one), so a long listing costs its changes only."""
    problems = []
    for listed in view.host_cached:
        entry = store.get(listed.key)
        if entry is None or not entry.intact:
            continue
        seen = judged.get(listed.key) if judged is not None else None
        if seen is not None and seen[1] is entry and seen[0] == listed:
            continue
        payload, n = entry.payload, len(listed.tokens)
        if payload.kind != listed.kind or entry.window_group != listed.window_group:
            problems.append(f"host entry {listed.key} is listed as {_host_what(listed.kind, listed.window_group)} "
                            f"but holds {_host_what(payload.kind, entry.window_group)}")
            continue
        if listed.kind == "state":
            for part, name in (("conv", "conv"), ("ssm", "matrix")):
                held = payload.prov.get(part)
                if held != listed.tokens:
                    problems.append(f"host entry {listed.key} is listed as the state after {n} tokens but its "
                                    f"{name} state is {_what(held, listed.tokens)}")
                    break
        else:
            rows = payload.prov["kv"]
            first = (n - 1) // block_size * block_size
            for pos in range(first, n):
                held = rows[pos - first] if pos - first < len(rows) else None
                if held != listed.tokens[: pos + 1]:
                    problems.append(f"host entry {listed.key} is listed as the KV block ending a {n}-token prefix"
                                    f"{'' if listed.window_group is None else f' (window group {listed.window_group})'}"
                                    f" but position {pos} holds {_what(held, listed.tokens[: pos + 1])}")
                    break
        if judged is not None and not problems:
            judged[listed.key] = (listed, entry)
    return problems


def _host_what(kind: str, group: int | None) -> str:
    return "a state" if kind == "state" else "full attention KV" if group is None else f"window group {group}'s KV"


def used_blocks(rs: RequestStep, block_size: int, windows: tuple[int, ...] = ()) -> list[tuple[str, int]]:
    """(which table, block) for every block the step reads or writes: its
    full attention table's through ``end``, and each window group's from the
    first position the window reads (entries before it are never read: a block
    that left the window may be freed, or null)."""
    B = block_size
    out = [("", b) for b in rs.block_table[: -(-rs.end // B)]]
    for g, table in enumerate(rs.window_tables if windows else ()):
        first = max(0, rs.start - windows[g] + 1)
        out += [(f" (window group {g})", b) for b in table[first // B: -(-rs.end // B)]]
    return out


def check_tables_referenced(view: CacheView, plan: StepPlan, block_size: int,
                            windows: tuple[int, ...] = ()) -> list[str]:
    """Every block a scheduled request reads or writes must be held (refcount >= 1):
    a window block the step still reads included, however far the request's
    computation is (a block freed on what a step in flight will have computed
    is read by that step: vllm#47728).  With no KV refcounts stated there is
    nothing to check (the caller notes it)."""
    if not view.kv_refcounts:
        return []
    problems = []
    for rs in plan.requests:
        for what, b in used_blocks(rs, block_size, windows):
            if b == NULL_BLOCK:
                problems.append(f"request {rs.request_id} reads or writes a position of its window through a null "
                                f"entry{what}")
            elif view.kv_refcounts.get(b, 0) < 1:
                problems.append(f"request {rs.request_id} uses KV block {b}{what}, which has refcount "
                                f"{view.kv_refcounts.get(b, 0)} (free or evictable while in use)")
    return problems


def check_holders_counted(view: CacheView, plan: StepPlan, block_size: int,
                          windows: tuple[int, ...] = ()) -> list[str]:
    """A refcount counts its holders: a KV block in the tables of k requests
    scheduled together has refcount >= k.  Counted once for two holders, the
    first to let go frees it (or queues it for eviction) while the other still
    reads it, and the next allocation overwrites it."""
    if not view.kv_refcounts:
        return []
    holders: dict[int, list[str]] = {}
    for rs in plan.requests:
        for b in dict.fromkeys(b for _, b in used_blocks(rs, block_size, windows) if b != NULL_BLOCK):
            holders.setdefault(b, []).append(rs.request_id)
    problems = []
    for b, reqs in holders.items():
        n = view.kv_refcounts.get(b, 0)
        if 1 <= n < len(reqs):  # 0 is check_tables_referenced's finding
            problems.append(f"KV block {b} is in the tables of {len(reqs)} scheduled requests "
                            f"({', '.join(reqs[:4])}) but has refcount {n}: when a holder lets go it is freed "
                            f"while the others still use it")
    return problems


def _what(held, wanted) -> str:
    if held is None:
        return "never-written memory"
    if wanted[: len(held)] == held:
        return f"the state after {len(held)} tokens of the same sequence"
    if held[: len(wanted)] == wanted:
        return f"the state after {len(held)} tokens (written after the prefix ended)"
    return f"content of another {len(held)}-token sequence"


def fail_if(kind: str, problems: list[str]) -> None:
    """Raise one failure naming the first problems (and how many more)."""
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConformanceFailure(kind, "; ".join(problems[:3]) + more)


class TablesReferenced(Checker):
    """Every block a scheduled request uses is held (refcount >= 1) in the view
    the implementation gives right after scheduling."""

    name = "tables-referenced"

    def scheduled(self, obs, ev):
        plan, view = ev.plan, ev.view
        if view is None:
            return
        if plan.requests and not view.kv_refcounts:
            self.notes.add(NO_KV_REFCOUNTS)  # reduced assurance, reported with the result
        windows = obs.memory.windows
        fail_if("invariant", check_tables_referenced(view, plan, obs.layout.block_size, windows))
        fail_if("invariant", check_holders_counted(view, plan, obs.layout.block_size, windows))


class ViewMatchesMemory(Checker):
    """After every step and abort: what the view registers as cached is what
    memory holds, refcounts are sane, nothing is held once all is idle."""

    name = "view-matches-memory"

    def __init__(self):
        super().__init__()
        self._host_judged: dict = {}  # host entries found right: key -> (listing, store entry)

    def settled(self, obs, ev):
        if not ev.view.state_refcounts:
            self.notes.add(NO_STATE_REFCOUNTS)
        fail_if("invariant", check_view(ev.view, obs.memory, idle=ev.idle))
        if not ev.view.host_cached and obs.transfers_succeeded.get("offload"):
            self.notes.add(NO_HOST_LISTING)  # reduced assurance, reported with the result
        if ev.view.host_cached:
            before = len(self._host_judged)
            fail_if("invariant", check_host_view(ev.view, obs.store, obs.layout.block_size, self._host_judged))
            self.count("host_entries_judged", len(self._host_judged) - before)
