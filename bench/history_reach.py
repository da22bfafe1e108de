"""Reach of the hard histories across seeds: per check (and configuration
variant) and seed, each hard-history counter its check requires, as the run
counted it.

    python bench/history_reach.py [--impl reference] [--seeds 0-9] [--check ID ...] [--no-matrix]
                                  [--jsonl FILE [--resume]] [--markdown]

A required counter (marked ``*``) at 0 at one seed is a history the
generator did not reach there (and a coverage failure of its check); the
other hard-history counters a check reached are listed too.  Each (check, seed) runs as the whole
profile would run it (a check's seed is its index in the profile), and its
counters are appended to ``--jsonl`` as it finishes; ``--resume`` keeps the
(check, seed) pairs that file holds and runs the rest, so an interrupted sweep
loses nothing and a finished one prints its table again without running.

A run is triaged as ``run`` triages it, against its implementation's
expectations file: a failed variant's cell is marked ``k`` when the failure
is a known defect or an expected one (its examples cut short by it, the
counters stop there) and ``N`` when it is NEW (a history not reached at that
seed reads NEW too); the exit status is 1 for a NEW failure or a required
counter at 0 outside a known failure, unless the cache's design or the pool
excused it (marked ``e``: the check's notes say why, docs/hard-histories.md).  The hard histories:
:mod:`conformance.judge.hard_coverage` and :mod:`conformance.judge.memory_coverage`
(docs/hard-histories.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conformance.judge.hard_coverage import HARD_COUNTERS, TRANSFER_COUNTERS  # noqa: E402
from conformance.judge.memory_coverage import MEMORY_COUNTERS  # noqa: E402
from conformance.judge.reach_coverage import REACH_COUNTERS  # noqa: E402
from conformance.results.triage import judge_file  # noqa: E402
from conformance.suite.checks import CHECKS  # noqa: E402
from conformance.suite.run import RunOptions, run  # noqa: E402

HARD = (set(HARD_COUNTERS) | set(TRANSFER_COUNTERS) | set(MEMORY_COUNTERS) | set(REACH_COUNTERS)
        | {"remote_expected", "tier_hits"})


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return seeds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="reference")
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--check", action="append", default=[],
                   help="a check id (default: every check that requires a hard-history counter)")
    p.add_argument("--no-matrix", action="store_true")
    p.add_argument("--jsonl", default="")
    p.add_argument("--resume", action="store_true", help="skip the (check, seed) pairs --jsonl holds already")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    checks = args.check or [s.id for s in CHECKS if HARD & set(s.required)]
    required = {s.id: [c for c in s.required if c in HARD] for s in CHECKS}
    rows: dict[tuple[str, str], dict[int, int]] = {}
    status: dict[tuple[str, int], str] = {}
    triaged: dict[tuple[str, int], str] = {}  # a failure's triage: "known D" | "expected" | "NEW"
    done: set[tuple[str, int]] = set()
    excused: set[tuple[str, str, int]] = set()  # (check, counter, seed): at 0, excused (marked e)
    if args.resume and args.jsonl and Path(args.jsonl).exists():
        for text in Path(args.jsonl).read_text().splitlines():
            line = json.loads(text)
            if line["check"].partition("[")[0] not in checks or line["seed"] not in parse_seeds(args.seeds):
                continue
            done.add((line["check"].partition("[")[0], line["seed"]))
            status[(line["check"], line["seed"])] = line["status"]
            triaged[(line["check"], line["seed"])] = line.get("triage", "")
            excused.update((line["check"], k, line["seed"]) for k in line.get("excused", ()))
            for k, n in line["coverage"].items():
                rows.setdefault((line["check"], k), {})[line["seed"]] = n
    for seed in parse_seeds(args.seeds):
        for check in checks:
            if (check, seed) in done:
                continue
            result = run(RunOptions(impl=args.impl, checks=(check,), seed=seed, write_reports=False,
                                    matrix=not args.no_matrix))
            by_check = judge_file(result.to_dict(), result.expectations["path"])[0].by_check \
                if result.expectations else {}
            for c in result.checks:
                base = c.id.partition("[")[0]
                status[(c.id, seed)] = c.status
                triaged[(c.id, seed)] = by_check.get(c.id, "NEW" if c.status in ("failed", "error") else "")
                # the counters its check requires, and any other hard-history counter it reached
                keys = required.get(base, []) + sorted(k for k in HARD - set(required.get(base, []))
                                                       if c.coverage.get(k, 0) > 0)
                line = {"check": c.id, "seed": seed, "status": c.status, "triage": triaged[(c.id, seed)],
                        "coverage": {k: c.coverage.get(k, 0) for k in keys},
                        # required counters the cache's design or the pool excused (their notes say why)
                        "excused": sorted(k for k in keys if any(n.startswith(k + " ") for n in c.notes))}
                for k, n in line["coverage"].items():
                    rows.setdefault((c.id, k), {})[seed] = n
                excused.update((c.id, k, seed) for k in line["excused"])
                if args.jsonl:
                    with open(args.jsonl, "a") as fh:
                        fh.write(json.dumps(line) + "\n")
                said = " ".join(x for x in (c.status, line["triage"], str(line["coverage"])) if x)
                print(f"  {c.id} seed {seed}: {said}", file=sys.stderr, flush=True)
    seeds = parse_seeds(args.seeds)
    header = ["check", "counter", *map(str, seeds), "min"]
    def name(check: str, counter: str) -> str:  # * marks a counter the check requires
        return counter + ("*" if counter in required.get(check.partition("[")[0], []) else "")

    def cell(check: str, counter: str, seed: int, n: int) -> str:
        # k: failed on a known or expected failure; N: NEW; e: at 0, excused by the design or the pool
        why = triaged.get((check, seed), "") if status.get((check, seed)) in ("failed", "error") else ""
        mark = "e" if (check, counter, seed) in excused else ""
        return f"{n}{mark}{'N' if why == 'NEW' else 'k' if why else ''}"

    table = [[check, name(check, counter), *(cell(check, counter, s, per.get(s, 0)) for s in seeds),
              str(min(per.get(s, 0) for s in seeds))] for (check, counter), per in rows.items()]
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        print("\n".join("| " + " | ".join(r) + " |" for r in table))
    else:
        widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
        for r in [header, *table]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    new = [key for key, why in triaged.items() if why == "NEW"]
    unreached = [(check, counter, s) for (check, counter), per in rows.items() for s in seeds
                 if counter in required.get(check.partition("[")[0], []) and per.get(s, 0) == 0
                 and (check, counter, s) not in excused
                 and not (triaged.get((check, s)) or "").startswith(("known", "expected"))]
    return 1 if new or unreached else 0


if __name__ == "__main__":
    sys.exit(main())
