"""Benchmark of the harness core: the quick profile against an implementation.

Prints state-machine throughput and where the time goes (oracle, harness,
implementation), measured in one run so the shares are comparable on a noisy
machine.  Targets (measured here, never asserted in tests): the quick profile
in <= 3 minutes on 2 cores against the reference; against vLLM, with its
configuration matrix, <= 5 minutes.  On a shared machine the absolute figures
drift, so ``--impl X`` also runs the reference's quick profile in the same
window (``--baseline``) and prints both side by side with their ratio.

    python bench/core.py [--impl vllm] [--profile quick] [--seed 0] [--baseline reference|none] [--no-matrix]
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


TARGETS = {"reference": 180, "vllm": 300}  # seconds for the quick profile on 2 cores


def measure(impl: str, args) -> tuple[float, object]:
    for key in SPENT:
        SPENT[key] = 0.0
    with timed_methods():
        t = time.perf_counter()
        result = run(RunOptions(impl=impl, profile=args.profile, seed=args.seed, write_reports=False,
                                matrix=not args.no_matrix))
        wall = time.perf_counter() - t
    report(args, result, wall)
    return wall, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--baseline", default="reference",
                    help="also run this implementation's profile in the same window (none: do not)")
    ap.add_argument("--no-matrix", action="store_true", help="run each check once (no configuration matrix)")
    args = ap.parse_args()
    if args.impl != "reference":
        from conformance.adapters import resolve

        resolve(args.impl)  # import it first: its import time is not the profile's
    wall, result = measure(args.impl, args)
    if args.baseline not in ("none", args.impl):
        base_wall, base = measure(args.baseline, args)
        print(f"side by side ({args.profile}, same window): {args.impl} {wall:.1f} s ({len(result.checks)} checks) | "
              f"{args.baseline} {base_wall:.1f} s ({len(base.checks)} checks) | ratio {wall / base_wall:.2f}")


def report(args, result, wall: float) -> None:
    steps = result.coverage.get("steps", 0)
    ops = sum(c.operations for c in result.checks)
    harness = wall - SPENT["oracle"] - SPENT["implementation"]
    target = TARGETS.get(result.implementation, 180)
    print(f"profile {args.profile} against {result.implementation}: {'ok' if result.ok else 'FAILED'} "
          f"({len(result.checks)} checks: {sum(c.status == 'passed' for c in result.checks)} passed)")
    print(f"  wall time            {wall:8.1f} s   (target <= {target} s for quick on 2 cores)")
    print(f"  engine steps         {steps:8d}     {steps / wall:8.1f} steps/s")
    print(f"  operations           {ops:8d}     {ops / wall:8.1f} ops/s")
    print(f"  reference runs       {result.metrics.get('reference_runs', 0):8d}")
    for name, spent in (("oracle", SPENT["oracle"]), ("implementation", SPENT["implementation"]),
                        ("harness (runner, memory, invariants, Hypothesis)", harness)):
        print(f"  {name:<50s} {spent:7.1f} s  {100 * spent / wall:5.1f} %")


if __name__ == "__main__":
    main()
