"""Benchmark of the harness core: the quick profile against the reference.

Prints state-machine throughput and where the time goes (oracle, harness,
implementation), measured in one run so the shares are comparable on a noisy
machine.  Targets (measured here, never asserted in tests): the quick profile
in <= 3 minutes on 2 cores.

    python bench/core.py [--profile quick] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

from conformance.harness import oracle as oracle_mod
from conformance.harness import session as session_mod
from conformance.suite.run import RunOptions, run

SPENT = {"oracle": 0.0, "implementation": 0.0}


@contextmanager
def timed_methods():
    """Wrap the oracle's entry points and the session's calls into the implementation."""
    patches = []

    def wrap(owner, name, bucket):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                SPENT[bucket] += time.perf_counter() - t

        setattr(owner, name, timed)
        patches.append((owner, name, original))

    for name in ("prime", "judge", "next_token"):
        wrap(oracle_mod.Oracle, name, "oracle")
    wrap(session_mod.Session, "call", "implementation")
    try:
        yield
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="reference")
    args = ap.parse_args()
    with timed_methods():
        t = time.perf_counter()
        result = run(RunOptions(impl=args.impl, profile=args.profile, seed=args.seed, write_reports=False))
        wall = time.perf_counter() - t
    steps = result.coverage.get("steps", 0)
    ops = sum(c.steps for c in result.checks)
    harness = wall - SPENT["oracle"] - SPENT["implementation"]
    print(f"profile {args.profile} against {result.implementation}: {'ok' if result.ok else 'FAILED'}")
    print(f"  wall time            {wall:8.1f} s   (target <= 180 s for quick on 2 cores)")
    print(f"  engine steps         {steps:8d}     {steps / wall:8.1f} steps/s")
    print(f"  operations           {ops:8d}     {ops / wall:8.1f} ops/s")
    print(f"  reference runs       {result.metrics.get('reference_runs', 0):8d}")
    for name, spent in (("oracle", SPENT["oracle"]), ("implementation", SPENT["implementation"]),
                        ("harness (runner, memory, invariants, Hypothesis)", harness)):
        print(f"  {name:<50s} {spent:7.1f} s  {100 * spent / wall:5.1f} %")


if __name__ == "__main__":
    main()
