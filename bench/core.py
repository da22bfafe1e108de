"""Benchmark of the harness core: the quick profile against an implementation.

Prints state-machine throughput and where the time goes (oracle, harness,
implementation), measured in one run so the shares are comparable on a noisy
machine.  Targets (measured here, never asserted in tests): the quick profile
in <= 3 minutes on 2 cores against the reference; against vLLM, with its
configuration matrix, <= 5 minutes.  On a shared machine the absolute figures
drift, so ``--impl X`` also runs the reference's quick profile in the same
window (``--baseline``) and prints both side by side with their ratio.

    python bench/core.py [--impl vllm] [--profile quick] [--seed 0] [--baseline reference|none] [--no-matrix]

A change's cost is measured against the commit before it, side by side: ``--against REV`` runs the same profile
from this checkout and from REV (a temporary git worktree), alternating them ``--rounds`` times, each run a fresh
``python -m conformance run`` process, and prints every wall time and CPU time (the run's processes, user + system:
on a shared machine it moves less with the load than the wall time), the medians and their ratios (this / REV):

    python bench/core.py --against main --rounds 2 [--impl reference] [--check ID ...] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

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
    ap.add_argument("--against", default=None, metavar="REV",
                    help="measure this checkout against git revision REV, side by side (alternating runs)")
    ap.add_argument("--rounds", type=int, default=2, help="with --against: runs of each side (default 2)")
    ap.add_argument("--check", action="append", default=[], help="with --against: only this check (repeatable)")
    ap.add_argument("--workers", type=int, default=1, help="with --against: run --workers N")
    args = ap.parse_args()
    if args.against:
        against(args)
        return
    if args.impl != "reference":
        from conformance.adapters import resolve

        resolve(args.impl)  # import it first: its import time is not the profile's
    wall, result = measure(args.impl, args)
    if args.baseline not in ("none", args.impl):
        base_wall, base = measure(args.baseline, args)
        print(f"side by side ({args.profile}, same window): {args.impl} {wall:.1f} s ({len(result.checks)} checks) | "
              f"{args.baseline} {base_wall:.1f} s ({len(base.checks)} checks) | ratio {wall / base_wall:.2f}")


ROOT = Path(__file__).resolve().parent.parent


def timed_run(tree: Path, args, out: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system, the run's processes together) and exit status of one
    ``python -m conformance run`` from ``tree``'s code.  On a machine shared with other jobs the CPU
    seconds move less than the wall time: a run that waits for a core is not charged for the wait."""
    cmd = [sys.executable, "-m", "conformance", "run", "--impl", args.impl, "--profile", args.profile,
           "--seed", str(args.seed), "--report-dir", str(out), "--workers", str(args.workers)]
    cmd += [f"--check={c}" for c in args.check] + (["--no-matrix"] if args.no_matrix else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    rc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, rc


def against(args) -> None:
    """This checkout and ``args.against`` alternated in one window: the ratio of their median wall times."""
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        sys.exit(f"--against {args.against!r}: not a git revision here ({rev.stderr.strip()})")
    with tempfile.TemporaryDirectory(prefix="bench-core-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), rev.stdout.strip()], cwd=ROOT,
                       check=True)
        try:
            times: dict[str, list[float]] = {"this": [], "old": []}
            cpu: dict[str, list[float]] = {"this": [], "old": []}
            for i in range(args.rounds):
                for side, tree in (("old", old), ("this", ROOT)) if i % 2 else (("this", ROOT), ("old", old)):
                    wall, used, rc = timed_run(tree, args, Path(tmp) / f"{side}{i}")
                    times[side].append(wall)
                    cpu[side].append(used)
                    print(f"round {i + 1} {side:4s} {wall:7.1f} s, CPU {used:7.1f} s (exit {rc}, load "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    a, b = statistics.median(times["this"]), statistics.median(times["old"])
    ca, cb = statistics.median(cpu["this"]), statistics.median(cpu["old"])
    load = os.getloadavg()[0]
    print(f"side by side ({args.impl}, {args.profile}, seed {args.seed}, load {load:.1f}): this checkout {a:.1f} s | "
          f"{args.against} ({rev.stdout.strip()}) {b:.1f} s | ratio {a / b:.2f} (CPU {ca:.1f} vs {cb:.1f} s: "
          f"ratio {ca / cb:.2f})")


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
