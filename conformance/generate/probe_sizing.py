"""Sizing the pool probe (:class:`~conformance.harness.ops.Probe`) on a fresh
instance of the implementation under test.

The probe's claim is relative, so it holds for any implementation without
knowing how it spends its pool: *at idle a cache serves what a fresh instance
of it serves*.  Here a fresh instance is measured once per implementation
and configuration (memoized for the process):

- ``concurrent``: as many 2-token requests as there are state slots,
  submitted together; ``expect`` is how many of them the fresh instance
  schedules in its first step (a leaked slot, or block, lowers it);
- ``kv_tokens``: the longest request the generator's budget allows for one
  request alone (:meth:`HybridCacheMachine.fits`: ``ceil((P + 1) / B) + 1``
  blocks, i.e. ``P = (num_kv_blocks - 1) * B - 1``), or, when the fresh
  instance cannot serve that much (vLLM spends its one pool on KV and state
  alike), the longest whole-block prompt it serves, one block less (so that
  a prefix hit that pins one more block cannot make a correct cache fail).

Why one block is what a correct cache owes: a hit that ends on a block
boundary costs at most the one state block it resumes from beyond what
recomputing costs.  A hit may cost more (a copy-on-write of a partial
block: vLLM's sub-block hits take three blocks more than a miss), but a
cache can always decline a hit that does not fit and recompute; one that
never does leaves a request that its own empty pool serves waiting forever
at idle.  That is a liveness defect, and the probe reports it as such (its
message names the held prefix, see :mod:`conformance.judge.lifetime`).

Calibration runs without checkers and without environment faults; an
implementation that fails or raises while being measured is probed only as
far as the measurement got (its check reports the failure itself).  One that
hangs is not measured further: the timeout is raised (the check reports it,
once: a fresh instance hung serving what the generator's budget allows),
never waited out again for each size the search would try.
"""

from __future__ import annotations

from conformance.contract import ImplConfig
from conformance.errors import ConformanceFailure, ImplementationError
from conformance.harness.ops import Drain, Probe, Step, Submit
from conformance.harness.oracle import Oracle
from conformance.harness.probe_prompts import SHORT_LEN, probe_prompts
from conformance.harness.session import Session, make_session
from conformance.model import TinyHybrid

_MEMO: dict = {}


def pool_probe(factory, impl_config: ImplConfig, model: TinyHybrid, oracle: Oracle,
               timeout: float | None = 30.0) -> Probe | None:
    """The probe for this implementation and configuration (None: nothing to probe)."""
    try:
        key = (factory, repr(impl_config), repr(model.config), str(model.dtype))
        hash(key)
    except TypeError:  # an unhashable factory: measure every time
        return _calibrate(factory, impl_config, model, oracle, timeout)
    if key not in _MEMO:
        _MEMO[key] = _calibrate(factory, impl_config, model, oracle, timeout)
    return _MEMO[key]


def _hung(exc: Exception) -> None:
    if isinstance(exc, ImplementationError) and exc.kind == "timeout":
        raise ImplementationError("timeout", f"while the pool probe was sized on a fresh instance: {exc}") from None


def _fresh(factory, impl_config, model, oracle, timeout) -> Session | None:
    try:
        session = make_session(factory, impl_config, model, oracle, [], timeout=timeout)
    except (ConformanceFailure, ImplementationError, TypeError) as exc:
        _hung(exc)
        return None
    session.runner.dry = True  # capacity only: no model runs, nothing is judged
    return session


def _calibrate(factory, impl_config, model, oracle, timeout) -> Probe | None:
    session = _fresh(factory, impl_config, model, oracle, timeout)
    if session is None:
        return None
    lay, vocab = session.layout, model.config.vocab_size
    concurrent, expect = lay.num_state_slots, 0
    short, _ = probe_prompts(vocab, 0, concurrent)
    try:
        for i, prompt in enumerate(short):
            session.apply(Submit(f"c{i}", prompt, 1))
        session.apply(Step(SHORT_LEN * concurrent))
        plan = session.last_plan
        expect = len(plan.requests) if plan is not None else 0
        session.apply(Drain(1024))
    except (ConformanceFailure, ImplementationError) as exc:
        _hung(exc)

    def serves(blocks: int) -> bool:
        fresh = _fresh(factory, impl_config, model, oracle, timeout)
        if fresh is None:
            return False
        _, prompt = probe_prompts(vocab, blocks * lay.block_size - 1, 0)
        try:
            fresh.apply(Submit("kv", prompt, 1))
            fresh.apply(Drain(1024))
            return True
        except (ConformanceFailure, ImplementationError) as exc:
            _hung(exc)
            return False

    most = lay.num_kv_blocks - 1  # the generator's budget for one request alone
    kv_blocks = 0
    if most >= 1 and serves(most):
        kv_blocks = most
    elif most > 1:
        lo, hi = 0, most - 1  # lo: served (0 trivially); find the largest served
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if serves(mid) else (lo, mid - 1)
        kv_blocks = max(0, lo - 1)
    kv_tokens = kv_blocks * lay.block_size - 1 if kv_blocks else 0
    if kv_tokens <= 0 and expect == 0:
        return None
    return Probe(kv_tokens=max(kv_tokens, 0), concurrent=concurrent if expect else 0, expect=expect)
