"""Mutant detection cost: per mutant, seconds and examples until the suite's
first failing example, and the length of the minimized repro.

    python bench/mutant_detection.py [--impl reference] [--seeds 0,1,2] [--only A,B] [--profile quick]

Targets (measured, not asserted): median <= 20 s, max <= 120 s to detection,
repros <= 8 operations.  Several seeds give a fairer picture than one: a
single seed can be lucky.  Costs count every check run before the one that
caught the mutant (the suite's checks run in profile order)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conformance.cli.cmd_mutants import mutants_for, run_mutant, select  # noqa: E402
from conformance.suite.run import RunOptions  # noqa: E402

TARGETS = {"median_s": 20.0, "max_s": 120.0, "repro_steps": 8}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="reference")
    p.add_argument("--seeds", default="0")
    p.add_argument("--only", default="")
    p.add_argument("--profile", default="quick")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    mutants = select(mutants_for(args.impl), args.only)
    rows, secs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for m in mutants:
            per_seed = [run_mutant(m, RunOptions(impl=args.impl, profile=args.profile, seed=s),
                                   Path(tmp) / f"{m.name}-{s}") for s in seeds]
            hit = [e for e in per_seed if e["detected"]]
            s_list = [e["seconds_to_detection"] for e in hit]
            secs += s_list
            rows.append((m.name, f"{len(hit)}/{len(seeds)}",
                         f"{statistics.median(s_list):.2f}" if s_list else "-",
                         f"{max(s_list):.2f}" if s_list else "-",
                         f"{statistics.median([e['examples_to_detection'] for e in hit]):g}" if hit else "-",
                         str(max(e["repro_steps"] or 0 for e in hit)) if hit else "-",
                         ",".join(sorted({e["check"] for e in hit})) or "-"))
            print(f"  {m.name}: done", file=sys.stderr, flush=True)
    header = ("mutant", "detected", "median s", "max s", "median examples", "max repro ops", "caught by")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if secs:
        med, mx = statistics.median(secs), max(secs)
        worst_repro = max((int(r[5]) for r in rows if r[5] != "-"), default=0)
        print(f"\nall mutants: median {med:.2f} s (target <= {TARGETS['median_s']:g}), "
              f"max {mx:.2f} s (target <= {TARGETS['max_s']:g}), longest repro {worst_repro} operations "
              f"(target <= {TARGETS['repro_steps']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
