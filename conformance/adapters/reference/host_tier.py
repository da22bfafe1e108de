"""A minimal host tier for the reference cache (``options={"host_tier": True}``).

Full KV blocks and snapshots that are about to be evicted are offloaded to
the harness's host store; a later request whose prefix continues into
offloaded entries has them loaded back before it is admitted, and then hits
them on the device like any cached entry.

Everything the host tier receives is distrusted: a load counts only if it
completed *and* the checksum of what landed equals the checksum the store
reported for the source bytes at offload time.  A failed, partial, corrupted,
lost or mismatched load is treated as a miss: the entry is forgotten, the
destination released, and the request recomputes (so logits stay right,
only reuse is lost).  Completions are matched by transfer id, never by order,
and a request waits until all of its loads have completed.  Each request
gets one round of loads, so a tier that keeps failing cannot starve it.
"""

from __future__ import annotations

from typing import Any, Literal

from conformance.adapters.reference.block_pool import ROOT, chain
from conformance.contract import HostCached, Transfer, TransferDone

Kind = Literal["kv", "state"]


def kv_key(prefix: tuple[int, ...]) -> str:
    return f"kv:{len(prefix)}:{hash(prefix) & 0xFFFFFFFFFFFF:x}"


def state_key(prefix: tuple[int, ...]) -> str:
    return f"state:{len(prefix)}:{hash(prefix) & 0xFFFFFFFFFFFF:x}"


class HostTier:
    def __init__(self, cache):
        self.cache = cache
        self.B = cache.B
        self.entries: dict[str, dict] = {}  # key -> what it holds and its source checksum
        self.inflight: dict[int, dict] = {}  # transfer id -> what to do on completion
        self.planned: list[Transfer] = []
        self.loading: dict[str, set[int]] = {}  # request id -> loads not completed yet
        self.held: dict[str, list[tuple[str, int]]] = {}  # request id -> loaded entries kept until admission
        self.tried: set[str] = set()
        self.aborted: set[str] = set()
        self.chosen: dict[str, int] = {}  # request id -> the remote tier's length, when it won
        self.compared: dict[str, tuple[int, int]] = {}  # request id -> (local, remote) when the remote won
        self.destinations: dict[str, tuple[list[int], int | None]] = {}  # request id -> its chain's blocks, state slot
        self.next_id = 0
        self.stats = {"offloads": 0, "loads": 0, "load_misses": 0}
        cache.kv.on_evict = self._evict_kv
        cache.states.on_evict = self._evict_state

    # -- the cache's hooks ---------------------------------------------------------------
    def is_loading(self, request_id: str) -> bool:
        return request_id in self.loading

    def listing(self) -> tuple[HostCached, ...]:
        """What the tier holds as loadable (offloads that completed), for the view."""
        return tuple(HostCached(k, e["prefix"], e["kind"]) for k, e in self.entries.items())

    def take(self) -> tuple[Transfer, ...]:
        planned, self.planned = self.planned, []
        return tuple(planned)

    def admitted(self, request_id: str) -> None:
        """The request took its own references: the tier's hold can go."""
        self.chosen.pop(request_id, None)
        self.compared.pop(request_id, None)
        self.destinations.pop(request_id, None)
        for kind, ident in self.held.pop(request_id, []):
            self._release(kind, ident)

    def forget(self, request_id: str) -> None:
        self.admitted(request_id)
        if request_id in self.loading:
            self.aborted.add(request_id)  # in-flight destinations are released on completion

    def complete(self, done: tuple[TransferDone, ...]) -> None:
        for d in done:
            info = self.inflight.pop(d.id, None)
            if info is None:
                continue  # not ours (or reported twice): ignore rather than trust
            if info["direction"] == "offload":
                if d.ok and d.checksum:
                    self.entries[info["key"]] = {**info, "checksum": d.checksum}
                continue
            self._loaded(info, d)

    # -- offload on eviction ---------------------------------------------------------------
    def _evict_kv(self, block: int, meta) -> None:
        if len(meta) != 3:
            return  # a window group's block: this tier keeps the full layers' KV and states only
        parent, block_tokens, prefix = meta
        if len(block_tokens) == self.B:  # partial tails are cheap to recompute: not worth a transfer
            self._offload("kv", block, kv_key(prefix), prefix=prefix, parent=parent, block_tokens=block_tokens)

    def _evict_state(self, slot: int, prefix) -> None:
        self._offload("state", slot, state_key(prefix), prefix=prefix)

    def _offload(self, kind: Kind, device: int, key: str, **info) -> None:
        if key in self.entries or any(i["key"] == key for i in self.inflight.values()):
            return
        t = self._transfer("offload", kind, key, device, None)
        self.inflight[t.id] = {"direction": "offload", "kind": kind, "key": key, **info}
        self.stats["offloads"] += 1

    # -- load before admission -------------------------------------------------------------
    def plan_loads(self, waiting) -> None:
        for req in waiting:
            if req.request_id not in self.loading and req.request_id not in self.tried:
                self._plan_for(req)

    def _plan_for(self, req) -> None:
        """Compare the tiers in tokens: the local hit (which may end inside a
        block) against the longest prefix the host tier could bring back (its
        KV blocks and the state at a block boundary).  The longer wins; a tie
        stays local (no transfer for the same reuse)."""
        prompt = req.tokens[: req.prompt_len]
        local = self.cache._match(prompt).length
        # A local hit that ends inside a block holds a block for its tail (the
        # copy it will write) while the tiers are compared: taken first, so
        # what the comparison sees is what is left after it.
        tail = self.cache._reserve_local_tail(prompt, local)
        B, parent, chain_ = self.B, ROOT, []
        for i in range(len(prompt) // B):
            block_tokens = tuple(prompt[i * B: (i + 1) * B])
            prefix = tuple(prompt[: (i + 1) * B])
            block, common = self.cache.kv.lookup(parent, block_tokens)
            if block is not None and common == B:
                chain_.append(block)  # on the device already
            elif kv_key(prefix) in self.entries:
                chain_.append({"key": kv_key(prefix), "parent": parent, "block_tokens": block_tokens,
                               "prefix": prefix})
            else:
                break
            parent = chain(parent, block_tokens)
        for k in range(len(chain_), 0, -1):
            p = k * B
            if p >= len(prompt):
                continue
            prefix = tuple(prompt[:p])
            if self.cache.states.lookup(prefix) is not None:
                state = self.cache.states.lookup(prefix)  # on the device already
            elif state_key(prefix) in self.entries:
                state = {"key": state_key(prefix), "prefix": prefix}
            else:
                continue
            if not self.cache._remote_wins(local, p):
                break
            self.cache._remote_won(tail)
            if self._load(req.request_id, chain_[:k], state):
                self.chosen[req.request_id] = p
                self.compared[req.request_id] = (local, p)
            return
        self.cache._release_local_tail(tail)  # the local tier stays: admission makes its own copy

    def remote_length(self, request_id: str) -> int | None:
        """The remote tier's length for a request whose loads all verified
        (None: the local tier won, or a load came back unusable)."""
        return self.chosen.get(request_id)

    def _load(self, rid: str, chain_: list, state) -> bool:
        """Load what the host holds of ``chain_`` (dicts; ints are blocks on
        the device) and ``state`` (a dict, or the device slot holding it).
        What is on the device is pinned first: the destinations allocated
        below must not evict the very entries the load joins."""
        pins = [("kv", b) for b in chain_ if isinstance(b, int)]
        pins += [("state", state)] if isinstance(state, int) else []
        for kind, ident in pins:
            (self.cache.kv if kind == "kv" else self.cache.states).acquire(ident)
        wanted: list[tuple[Kind, Any]] = [("kv", b) for b in chain_ if isinstance(b, dict)]
        wanted += [("state", state)] if isinstance(state, dict) else []
        dests: list[tuple[str, int]] = []
        for kind, _ in wanted:
            dest = (self.cache.kv if kind == "kv" else self.cache.states).allocate()
            if dest is None:  # no room: give up on this round (the request recomputes)
                for k, d in dests + pins:
                    self._release(k, d)
                return False
            dests.append((kind, dest))
        self.tried.add(rid)
        it = iter(d for _, d in dests)
        blocks = [b if isinstance(b, int) else next(it) for b in chain_]
        self.destinations[rid] = (blocks, state if isinstance(state, int) else (next(it) if state else None))
        self.held.setdefault(rid, []).extend(pins)  # released when the request is admitted (or aborted)
        ids = set()
        for (kind, info), (_, dest) in zip(wanted, dests):
            t = self._transfer("load", kind, info["key"], dest, rid)
            self.inflight[t.id] = {"direction": "load", "kind": kind, "dest": dest, "request": rid,
                                   "expected": self.entries[info["key"]]["checksum"], **info}
            ids.add(t.id)
        if ids:
            self.loading[rid] = ids
        self.stats["loads"] += len(ids)
        return True

    def _loaded(self, info: dict, d: TransferDone) -> None:
        rid, kind, dest = info["request"], info["kind"], info["dest"]
        verified = d.ok and d.checksum is not None and d.checksum == info["expected"]
        registered = False
        if verified:
            if kind == "kv":
                self.cache.kv.register(info["parent"], info["block_tokens"], info["prefix"], dest)
                registered = self.cache.kv.meta.get(dest, (None, None, None))[2] == info["prefix"]
            else:
                registered = self.cache.states.register(info["prefix"], dest)
        else:
            self.entries.pop(info["key"], None)  # the copy on the host is not to be trusted again
            self.stats["load_misses"] += 1
            self.chosen.pop(rid, None)  # what the remote tier promised did not arrive: a miss
        pending = self.loading.get(rid)
        if pending is not None:
            pending.discard(d.id)
            if not pending:
                del self.loading[rid]
        if registered and rid not in self.aborted:
            self.held.setdefault(rid, []).append((kind, dest))
        else:
            self._release(kind, dest)
        if rid not in self.loading:
            self.aborted.discard(rid)

    # -- helpers ---------------------------------------------------------------------------
    def _transfer(self, direction: Literal["offload", "load"], kind: Kind, key: str, device: int,
                  rid: str | None) -> Transfer:
        self.next_id += 1
        t = Transfer(self.next_id, direction, kind, key, device, rid)
        self.planned.append(t)
        return t

    def _release(self, kind: str, ident: int) -> None:
        (self.cache.kv if kind == "kv" else self.cache.states).release(ident)
