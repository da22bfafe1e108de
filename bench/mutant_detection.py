"""Mutant detection across seeds: per mutant and seed, whether the suite caught
it, which check, the seconds and examples until the first failing example,
and the length of the minimized repro.

    python bench/mutant_detection.py [--impl reference] [--seeds 0-9] [--only A,B] [--profile quick]
                                     [--check ID ...] [--jsonl FILE [--resume]] [--markdown]

``hybrid-conformance mutants`` runs one seed; a mutant caught at one seed can
escape at another (the generator never reached its history there), so this
runs each mutant at every seed of ``--seeds`` (``0-9``, ``0,3,5``) and prints,
per mutant, the seeds at which the suite caught it, the median and the
maximum seconds to the first failing example over those seeds, and the
checks that caught it.  Caught means caught by the suite's general checks
(``SUITE_DETECTION`` in :mod:`conformance.cli.cmd_mutants`), never by the
mutant's own crash or a coverage failure.  Costs count every check run
before the one that caught the mutant (the suite's checks run in profile
order).  Each finished (mutant, seed) is appended to ``--jsonl`` at once, so
an interrupted sweep keeps what finished, and a second run with the same
file skips what is there (``--resume``).

``--check ID`` (repeatable) runs only those checks, in profile order.  A
check draws the same examples alone as in the whole profile (its seed is its
index in the profile, :func:`conformance.suite.checks.seed_index`), so a
mutant caught there is caught by the profile at that seed, by that check or
an earlier one; the seconds then count the checks run only (a mutant caught
late in the profile costs the earlier checks' time too, about the reference's
time for them).  The table's last column says which checks ran.

Targets (measured, not asserted): every mutant caught at every seed; median
<= 20 s, max <= 120 s to detection; repros <= 8 operations."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conformance.cli.cmd_mutants import mutants_for, run_mutant, select  # noqa: E402
from conformance.suite.checks import PROFILES  # noqa: E402
from conformance.suite.run import RunOptions  # noqa: E402

TARGETS = {"median_s": 20.0, "max_s": 120.0, "repro_steps": 8}


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return seeds


def rows(entries: dict[tuple[str, int], dict], names: list[str], seeds: list[int]) -> list[tuple[str, ...]]:
    out = []
    for name in names:
        per = [entries[(name, s)] for s in seeds if (name, s) in entries]
        hit = [e for e in per if e["detected"]]
        secs = [e["seconds_to_detection"] for e in hit if e["seconds_to_detection"] is not None]
        missed = [str(s) for s in seeds if (name, s) in entries and not entries[(name, s)]["detected"]]
        out.append((name, f"{len(hit)}/{len(per)}", ",".join(missed) or "-",
                     f"{statistics.median(secs):.1f}" if secs else "-", f"{max(secs):.1f}" if secs else "-",
                     str(max((e["repro_steps"] or 0) for e in hit)) if hit else "-",
                     ", ".join(sorted({e["check"] for e in hit})) or "-",
                     " / ".join(sorted({", ".join(e.get("checks_requested") or ["profile"]) for e in per})) or "-"))
    return out


HEADER = ("mutant", "caught", "missed at seeds", "median s", "max s", "max repro ops", "caught by", "checks run")


def render(table: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table])
    widths = [max(len(r[i]) for r in [*table, HEADER]) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [HEADER, *table])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="reference")
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--only", default="")
    p.add_argument("--profile", default="quick")
    p.add_argument("--check", action="append", default=[],
                   help="run only this check (repeatable; profile order, the profile's draws)")
    p.add_argument("--jsonl", default="", help="append one line per (mutant, seed) here as it finishes")
    p.add_argument("--resume", action="store_true", help="skip the (mutant, seed) pairs --jsonl holds already")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown")
    args = p.parse_args()
    seeds = parse_seeds(args.seeds)
    mutants = select(mutants_for(args.impl), args.only)
    known = [c.id for c in PROFILES[args.profile].checks] if args.profile in PROFILES else []
    if args.profile not in PROFILES or any(c not in known for c in args.check):
        bad = args.profile if args.profile not in PROFILES else next(c for c in args.check if c not in known)
        print(f"mutant_detection: unknown profile or check {bad!r}; checks: {', '.join(known)}", file=sys.stderr)
        return 2
    checks = tuple(c for c in known if c in args.check)  # profile order
    entries: dict[tuple[str, int], dict] = {}
    sink = Path(args.jsonl) if args.jsonl else None
    if sink is not None and args.resume and sink.exists():
        for line in sink.read_text().splitlines():
            e = json.loads(line)
            entries[(e["name"], e["seed"])] = e
    with tempfile.TemporaryDirectory() as tmp:
        for m in mutants:
            for s in seeds:
                if (m.name, s) in entries:
                    continue
                e = run_mutant(m, RunOptions(impl=args.impl, profile=args.profile, seed=s, checks=checks),
                               Path(tmp) / f"{m.name}-{s}")
                e = {k: e[k] for k in ("name", "detected", "check", "kind", "examples_to_detection",
                                       "seconds_to_detection", "repro_steps", "seconds", "checks_run")} | \
                    {"seed": s, "checks_requested": list(checks)}
                entries[(m.name, s)] = e
                if sink is not None:
                    with sink.open("a") as fh:
                        fh.write(json.dumps(e) + "\n")
                print(f"  {m.name} seed {s}: " + (f"caught by {e['check']} ({e['kind']}) after "
                                                  f"{e['seconds_to_detection']} s" if e["detected"] else "MISSED"),
                      file=sys.stderr, flush=True)
    names = [m.name for m in mutants]
    print(render(rows(entries, names, seeds), args.markdown))
    hit = [e for e in entries.values() if e["detected"] and e["name"] in names and e["seed"] in seeds]
    secs = [e["seconds_to_detection"] for e in hit if e["seconds_to_detection"] is not None]
    total = sum(1 for k in entries if k[0] in names and k[1] in seeds)
    if secs:
        worst = max((e["repro_steps"] or 0) for e in hit)
        print(f"\n{len(hit)}/{total} (mutant, seed) pairs caught; median {statistics.median(secs):.1f} s "
              f"(target <= {TARGETS['median_s']:g}), max {max(secs):.1f} s (target <= {TARGETS['max_s']:g}) to the "
              f"first failing example; longest repro {worst} operations (target <= {TARGETS['repro_steps']})")
    return 0 if len(hit) == total else 1


if __name__ == "__main__":
    sys.exit(main())
