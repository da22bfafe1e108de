"""``hybrid-conformance mutants``: the suite's self-check.

Runs the suite against every mutant registered for an implementation (a
seeded, realistic bug in one decision), stopping each mutant's run at its
first failing check, and writes ``mutants.json``: which check caught which
mutant, after how many examples and seconds, and how short the minimized
repro is.  A mutant the suite misses means the suite has a blind spot, so the
exit status is 0 only when every mutant is caught by the suite.

Caught by the suite means a general checker failed it (``SUITE_DETECTION``)
with a failure that is not a known defect of the engine version: a seeded bug
placed where a known defect also fires is caught only when the run names it
NEW (the known one is recorded in ``known_defects`` and explored past).
A mutant whose own code raised or hung (``CRASHED_ITSELF``: an assertion of
the implementation it wraps) caught itself, and a coverage failure says the
situation never occurred, not that a result was wrong: both are recorded
(``crashed_itself``, ``not_detections``) and never counted.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from conformance.cli.common import add_impl_options, parse_options, positive_int
from conformance.errors import UsageError
from conformance.results.files import strict_json
from conformance.suite.run import RunOptions, run

# What counts as the suite detecting a mutant: a general checker found a wrong
# result or broken bookkeeping (wrong logits, a broken invariant or retention
# promise, a plan that breaks the contract, no progress).
SUITE_DETECTION = ("logits", "invariant", "contract", "stall", "retention", "hit-rate")
# The mutant's own code raised or hung (an assertion of the implementation it
# wraps, for example): the implementation caught itself, the suite did not.
# Recorded apart, and the remaining checks still get their chance.
CRASHED_ITSELF = ("raised", "timeout")
# Neither: the situation never occurred (coverage: the mutant may have changed
# what the generator reaches, which says nothing about a wrong result) or the
# harness crashed.  Recorded, and the remaining checks still get their chance.
NOT_DETECTION = ("coverage", "harness")


def add_parser(sub) -> None:
    p = sub.add_parser("mutants", help="check that the suite detects every registered mutant")
    add_impl_options(p)
    p.add_argument("--only", default=None, help="only these mutants, comma separated")
    p.add_argument("--profile", default="quick", help="quick, standard or nightly (default quick)")
    p.add_argument("--check", action="append", default=[], help="run only this check id (repeatable)")
    p.add_argument("--examples", type=positive_int, default=None,
                   help="Hypothesis examples per check (overrides profile)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="Hypothesis steps per example (rule calls; overrides profile)")
    p.set_defaults(func=main)


def mutants_for(impl: str) -> list:
    """The registered mutants that apply to ``impl`` (vLLM's only for ``vllm``:
    importing them needs vLLM)."""
    from fault_injection.catalog import all_mutants

    MUTANTS = all_mutants()
    target = impl if impl in ("vllm", "sglang") else "reference"
    if impl not in ("reference", "vllm", "sglang"):  # module:Class: reference mutants subclass the reference only
        from conformance.adapters import resolve
        from conformance.adapters.reference import ReferenceCache

        factory = resolve(impl)
        if not (isinstance(factory, type) and issubclass(factory, ReferenceCache)):
            return []
    # The reference's disaggregated mode has its own mutants, caught by the disagg family;
    # its speculative decoding too, caught by the spec family.
    targets = {target, f"{target}-disagg", f"{target}-spec"} if target in ("reference", "vllm") else {target}
    # a fix (bug class FIX) removes a known defect's cause: nothing to catch (run --mutant NAME says FIXED)
    return [m for m in MUTANTS.values() if m.target in targets and m.fixes is None]


def planned_checks(mutant, profile: str) -> list[str]:
    """The profile's checks, in order.  A mutant of a disaggregated mode (the
    reference's, vLLM's) runs only the checks that execute that mode (the disagg family): the
    single-worker checks never call it, so they cannot catch it and would only
    spend time.  Likewise a mutant of speculative decoding (target ``*-spec``)
    runs only the checks that verify drafts (the spec family)."""
    from conformance.suite.checks import PROFILES

    specs = PROFILES[profile].checks
    if mutant is not None and mutant.target.endswith("-disagg"):
        specs = tuple(s for s in specs if s.disagg)
    if mutant is not None and mutant.target.endswith("-spec"):  # only checks that verify drafts meet the code
        specs = tuple(s for s in specs if s.spec)
    if mutant is not None and getattr(mutant, "family", None):  # e.g. a mutant of the second tier: the tier family
        specs = tuple(s for s in specs if s.family == mutant.family)
    return [s.id for s in specs]


def select(mutants: list, only: str | None) -> list:
    if only is None:
        return mutants
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    if not wanted:  # "--only ''" or "--only ,": an empty selection is not "all of them"
        raise UsageError(f"--only {only!r}: names no mutant (leave the flag out for every mutant)")
    known = {m.name for m in mutants}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [m for m in mutants if m.name in wanted]


def run_mutant(mutant, base: RunOptions, report_dir: Path) -> dict:
    """One mutant through the suite, up to the first check that catches it.
    A failure that says nothing about the mutant (a situation that never
    occurred) does not stop it: the remaining checks still get their chance."""
    remaining = list(base.checks) or planned_checks(mutant, base.profile)
    entry = {"name": mutant.name, "class": mutant.bug_class, "description": mutant.description,
             "detected": False, "check": None, "kind": None, "message": None,
             "examples_to_detection": None, "seconds_to_detection": None, "repro_steps": None, "repro": None,
             "checks_run": [], "seconds": None, "report_dir": str(report_dir), "not_detections": [],
             "crashed_itself": [], "known_defects": []}
    _clear_parts(report_dir)
    started = time.perf_counter()
    # Detection cost counts every check run before the one that caught it:
    # that is what the suite spent to find the bug.
    examples_before, seconds_before = 0, 0.0
    part = 0
    while remaining:
        out = report_dir if part == 0 else report_dir / f"part{part + 1}"
        result = run(RunOptions(**{**base.__dict__, "mutant": mutant.name, "report_dir": out,
                                   "checks": tuple(remaining), "stop_at_failure": True, "progress": None,
                                   "shrink": "ops"}))
        part += 1
        remaining = []
        for i, c in enumerate(result.checks):
            entry["checks_run"].append(c.id)
            f = c.failure
            for met in c.known_defects:
                entry["known_defects"].append({"check": c.id, "defect": met["defect"], "count": met["count"]})
            if c.status in ("failed", "error") and f is not None and c.id != "faults-exercised":
                if f.defect:
                    # a known defect of the engine version, not the mutant: the run explored past it
                    continue
                if f.kind not in SUITE_DETECTION:
                    into = "crashed_itself" if f.kind in CRASHED_ITSELF else "not_detections"
                    entry[into].append({"check": c.id, "kind": f.kind, "message": f.message[:300]})
                    remaining = [spec_id for spec_id in _ids_after(result, i, base)]
                    examples_before += c.examples
                    seconds_before += c.seconds
                    break
                entry.update(detected=True, check=c.id, kind=f.kind, message=f.message[:500],
                             repro_steps=len(f.operations) if f.operations else None, repro=f.repro)
                if f.examples_to_failure is not None:
                    entry["examples_to_detection"] = examples_before + f.examples_to_failure
                    entry["seconds_to_detection"] = round(seconds_before + (f.seconds_to_failure or 0.0), 3)
                entry["seconds"] = round(time.perf_counter() - started, 3)
                return entry
            examples_before += c.examples
            seconds_before += c.seconds
    entry["seconds"] = round(time.perf_counter() - started, 3)
    return entry


def _clear_parts(report_dir: Path) -> None:
    """The ``partN`` report directories an earlier self-check into the same
    directory left (this one may stop at an earlier part): cleared of what the
    suite wrote there, and removed when nothing else is left."""
    from conformance.results.report import clear_previous_run

    for part in sorted(report_dir.glob("part*")) if report_dir.is_dir() else []:
        if part.is_dir() and not part.is_symlink() and part.name[4:].isdigit():
            clear_previous_run(part)
            try:
                part.rmdir()
            except OSError:
                pass  # something else is in it: it stays


def _ids_after(result, i: int, base: RunOptions) -> list[str]:
    """The checks of this run that come after check ``i`` (not run: the run stopped there)."""
    planned = list(base.checks) or planned_checks(None, base.profile)
    ran = [c.id for c in result.checks]
    return planned[planned.index(ran[i]) + 1:] if ran[i] in planned else []


def summarize(entries: list[dict]) -> dict:
    secs = sorted(e["seconds_to_detection"] for e in entries if e["detected"] and e["seconds_to_detection"] is not None)
    steps = [e["repro_steps"] for e in entries if e["repro_steps"] is not None]
    median = (secs[len(secs) // 2] if len(secs) % 2 else (secs[len(secs) // 2 - 1] + secs[len(secs) // 2]) / 2) \
        if secs else None
    return {"mutants": len(entries), "detected": sum(e["detected"] for e in entries),
            "missed": [e["name"] for e in entries if not e["detected"]],
            # the mutant's own code raised or hung somewhere (the suite may still have caught it elsewhere)
            "crashed_itself": [e["name"] for e in entries if e.get("crashed_itself")],
            "median_seconds_to_detection": None if median is None else round(median, 3),
            "max_seconds_to_detection": secs[-1] if secs else None,
            "max_repro_steps": max(steps) if steps else None}


def table(entries: list[dict]) -> str:
    rows = [("mutant", "class", "caught by the suite", "check", "kind", "examples", "seconds", "repro ops",
             "crashed itself")]
    for e in entries:
        crashed = ", ".join(f"{c['check']} ({c['kind']})" for c in e.get("crashed_itself", [])) or "-"
        rows.append((e["name"], e["class"], "yes" if e["detected"] else "NO", e["check"] or "-", e["kind"] or "-",
                     str(e["examples_to_detection"] or "-"), str(e["seconds_to_detection"] or "-"),
                     str(e["repro_steps"] or "-"), crashed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def main(args) -> int:
    chosen = select(mutants_for(args.impl), args.only)
    if not chosen:
        raise UsageError(f"no mutants are registered for --impl {args.impl}")
    from conformance.suite.options import default_report_dir
    from conformance.suite.prepare import check_report_dir, prepare_run

    base = RunOptions(impl=args.impl, profile=args.profile, seed=args.seed, checks=tuple(args.check),
                      timeout=args.timeout, examples=args.examples, steps=args.steps,
                      impl_options=parse_options(args.option), block_size=args.block_size,
                      num_kv_blocks=args.kv_blocks, num_state_slots=args.state_slots)
    # Every usage error before any work: the options as each mutant's run will check them, and the directory.
    prepare_run(replace(base, write_reports=False))
    if args.report_dir is not None:
        check_report_dir(args.report_dir)
    out = Path(args.report_dir or default_report_dir(f"mutants-{args.impl}", args.seed))
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, mutant in enumerate(chosen):
        print(f"[{i + 1}/{len(chosen)}] {mutant.name} ...", file=sys.stderr, flush=True)
        entry = run_mutant(mutant, base, out / mutant.name)
        entries.append(entry)
        verdict = f"caught by the suite: {entry['check']} ({entry['kind']})" if entry["detected"] else \
            "NOT CAUGHT BY THE SUITE"
        for c in entry["crashed_itself"]:
            verdict += f"; crashed itself in {c['check']} ({c['kind']}: {c['message'][:120]})"
        print(f"    {verdict} in {entry['seconds']:.1f}s", file=sys.stderr, flush=True)
        write(out, args.impl, entries)  # after each mutant: an interrupted run keeps what finished
    doc = write(out, args.impl, entries)
    print(table(entries))
    s = doc["summary"]
    print(f"{s['detected']}/{s['mutants']} mutants caught by the suite ({len(s['crashed_itself'])} crashed "
          f"themselves somewhere, not counted); median {s['median_seconds_to_detection']} s, "
          f"max {s['max_seconds_to_detection']} s to detection; longest repro {s['max_repro_steps']} operations; "
          f"{out / 'mutants.json'}", file=sys.stderr)
    return 0 if s["detected"] == s["mutants"] else 1


def write(out: Path, impl: str, entries: list[dict]) -> dict:
    doc = {"implementation": impl, "summary": summarize(entries), "mutants": entries}
    tmp = out / "mutants.json.tmp"
    tmp.write_text(strict_json(doc, indent=2, default=str) + "\n")
    tmp.replace(out / "mutants.json")
    return doc
