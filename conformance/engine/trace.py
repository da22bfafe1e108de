"""Running a workload on the cached engine and recording what came back.

The cached engine is driven first for every check (references are computed
afterwards, in bulk, memoized).  An engine failure stops that workload only; the
engine is restarted lazily before the next one (its cache is then empty, so
the upper bound on plausible hits is reset too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conformance.engine.adapter import EngineOutput
from conformance.engine.workloads import Req, Workload
from conformance.errors import EngineError


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CachedEngine:
    """The engine under test, plus what it has seen since its last (re)start:
    a hit can never be longer than a prefix the engine has been shown."""

    def __init__(self, engine):
        self.engine = engine
        self.seen: list[tuple[int, ...]] = []
        self.dirty = False  # an error happened: restart before the next use
        self.epoch = 0

    def ensure(self) -> None:
        if self.engine.worker is None or self.dirty:
            self.engine.restart() if self.engine.worker is not None else self.engine.start()
            self.seen = []
            self.dirty = False
            self.epoch += 1

    def hit_bound(self, prompt: tuple[int, ...], round_prompts: list[tuple[int, ...]], me: int) -> int:
        best = max((lcp(prompt, s) for s in self.seen), default=0)
        # Requests of the same call can serve each other (one is scheduled first).
        best = max([best] + [lcp(prompt, p) for j, p in enumerate(round_prompts) if j != me])
        return min(best, len(prompt) - 1)


@dataclass
class Trace:
    check_id: str
    family: str
    rounds: list[list[Req]] = field(default_factory=list)
    outputs: list[list[EngineOutput]] = field(default_factory=list)
    bounds: list[list[int]] = field(default_factory=list)  # plausible-hit upper bound per request
    error: EngineError | None = None
    error_round: int | None = None
    seconds: float = 0.0
    epoch: int = 0
    # The P/D family's: per request, the longest prefix the decode engine itself was shown (pd_checks).
    local_bounds: list[int] = field(default_factory=list)

    def requests(self):
        for rnd, outs, bnds in zip(self.rounds, self.outputs, self.bounds):
            yield from zip(rnd, outs, bnds)

    def repro(self, upto: int | None = None) -> list[dict]:
        last = len(self.rounds) if upto is None else upto + 1
        return [{"round": i, "requests": [r.to_dict() for r in rnd]} for i, rnd in enumerate(self.rounds[:last])]


def run_workload(check_id: str, family: str, cached: CachedEngine, workload: Workload) -> Trace:
    tr = Trace(check_id, family)
    t0 = time.monotonic()
    try:
        cached.ensure()
    except EngineError as e:
        tr.error, tr.error_round = e, -1
        cached.dirty = True
        tr.seconds = time.monotonic() - t0
        return tr
    tr.epoch = cached.epoch
    outs = None
    try:
        rnd = next(workload)
        while True:
            tr.rounds.append(rnd)
            ns = {r.max_tokens for r in rnd}
            assert len(ns) == 1, "a round shares one max_tokens"
            prompts = [r.prompt for r in rnd]
            bounds = [cached.hit_bound(p, prompts, i) for i, p in enumerate(prompts)]
            try:
                outs = cached.engine.generate(prompts, ns.pop())
            except EngineError as e:
                tr.error, tr.error_round = e, len(tr.rounds) - 1
                cached.dirty = True
                break
            tr.outputs.append(outs)
            tr.bounds.append(bounds)
            cached.seen.extend(p + o.tokens for p, o in zip(prompts, outs))
            rnd = workload.send(outs)
    except StopIteration:
        pass
    finally:
        workload.close()
    tr.seconds = time.monotonic() - t0
    return tr
