"""Merging the results of the shards of one run (``--shard i/n`` on several
CI runners) into one report directory: results.json, junit.xml, index.html
and repros/ (paths rewritten to the merged copies).

    python -m conformance.suite.merge OUT SHARD_DIR [SHARD_DIR ...]

Each shard records ``"shard": "I/N"`` and the whole run's plan (``unsplit``):
a shard that is missing (a runner that died or was cancelled before it
uploaded) has its checks listed as not run ("shard 3/3 missing"), and so do
the checks a shard did not finish; the merged verdict is then incomplete and
the exit status 1, never "merged 2 shards: 10 passed" and green."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from conformance.errors import CompareInputError, UsageError
from conformance.results.compare import load_results
from conformance.results.records import RunResult, result_from_dict
from conformance.suite.checks import CATALOGUE

_ORDER = {spec.id: i for i, spec in enumerate(CATALOGUE)}


def merge(out: Path, dirs: list[Path]) -> RunResult:
    from conformance.results.report import ReportDir

    if any(Path(d).resolve() in (out.resolve(), out.resolve() / "results.json") for d in dirs):
        raise CompareInputError(f"{out}: is one of the shards; merge into another directory")
    docs = [load_results(d) for d in dirs]
    if not docs:
        raise CompareInputError("nothing to merge")
    first = docs[0]
    for d, path in zip(docs[1:], dirs[1:]):
        for key in ("implementation", "implementation_version", "seed", "profile", "mutant"):
            if d.get(key) != first.get(key):
                raise CompareInputError(f"{path}: {key} {d.get(key)!r} differs from {first.get(key)!r}: "
                                        f"not shards of one run")
    shards = [_shard_of(d, path) for d, path in zip(docs, dirs)]
    ns = {n for _, n in filter(None, shards)}
    if len(ns) > 1:
        raise CompareInputError(f"shards of different splits ({', '.join(f'/{n}' for n in sorted(ns))}): not shards "
                                f"of one run")
    if ns and None in shards:
        raise CompareInputError(f"{dirs[shards.index(None)]}: not a shard (no \"shard\": I/N): cannot be merged with "
                                f"shards")
    merged = result_from_dict(first)
    merged.checks, merged.faults, merged.not_run, merged.not_run_reasons = [], {}, [], {}
    merged.shard, merged.unsplit, merged.verdict, merged.planned = "", [], None, []
    # Held, and what an earlier merge (or run) left there cleared, before anything is copied in (a lock
    # left by a merge that raised below is taken over: its process is gone).
    reports = ReportDir(out).open()
    (out / "repros").mkdir(exist_ok=True)
    seen = set()
    unfinished = False
    for d, src in zip(docs, dirs):
        part = result_from_dict(d)
        for c in part.checks:
            if c.id in seen:
                raise CompareInputError(f"{src}: check {c.id} is in two shards")
            seen.add(c.id)
            copied = {}
            for met in c.known_defects:  # repros/known/<defect>/<check>.json
                if met.get("repro") and Path(met["repro"]).exists():
                    dest = out / "repros" / "known" / met["defect"] / Path(met["repro"]).name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(met["repro"], dest)
                    copied[met["repro"]] = met["repro"] = str(dest)
            if c.failure is not None and c.failure.repro in copied:
                c.failure.repro = copied[c.failure.repro]
            elif c.failure is not None and c.failure.repro and Path(c.failure.repro).exists():
                dest = out / "repros" / Path(c.failure.repro).name
                shutil.copyfile(c.failure.repro, dest)
                c.failure.repro = str(dest)
            merged.checks.append(c)
        merged.interrupted = merged.interrupted or part.interrupted
        merged.crashed = merged.crashed or part.crashed
        where = f" (shard {part.shard})" if part.shard else ""
        for cid in part.not_run:
            merged.not_run.append(cid)
            merged.not_run_reasons[cid] = part.not_run_reason(cid) + where
        unfinished = unfinished or part.finished is None
        merged.finished = max(filter(None, [merged.finished, part.finished]), default=None)
        for name, info in part.faults.items():
            into = merged.faults.setdefault(name, {})
            for k, v in (info or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    into[k] = into.get(k, 0) + v  # each shard counted its own firings
                else:
                    into.setdefault(k, v)
        for png in Path(src if Path(src).is_dir() else Path(src).parent).glob("*.png"):
            shutil.copyfile(png, out / png.name)
    missing: list[str] = []
    if ns:
        (n,) = ns
        present = {i for i, _ in filter(None, shards)}
        if len(present) != len(shards):
            raise CompareInputError("the same shard twice: not shards of one run")
        unsplit = next((d.get("unsplit") for d in docs if d.get("unsplit")), None)
        for i in sorted(set(range(1, n + 1)) - present):
            missing.append(f"{i}/{n}")
            ids = [cid for k, cid in enumerate(unsplit) if k % n == i - 1] if unsplit else [f"(shard {i}/{n})"]
            for cid in ids:
                merged.not_run.append(cid)
                merged.not_run_reasons[cid] = f"shard {i}/{n} missing" + ("" if unsplit else ": its checks are unknown")
        merged.planned = list(unsplit) if unsplit else [c.id for c in merged.checks] + merged.not_run
    else:
        merged.planned = [c.id for c in merged.checks] + merged.not_run
    if unfinished:
        merged.finished = None  # a shard that never finished: so has the run
    merged.checks.sort(key=lambda c: _ORDER.get(c.id, len(_ORDER)))
    merged.metrics = {"merged_from": [str(p) for p in dirs], "missing_shards": missing}
    from conformance.results.verdict import judge_run

    merged.verdict = judge_run(merged)
    reports.write(merged)
    reports.close()
    return merged


def _shard_of(doc: dict, path: Path) -> tuple[int, int] | None:
    """(I, N) of a shard's results.json (older harnesses recorded it under ``metrics``); None: a whole run."""
    text = doc.get("shard") or (doc.get("metrics") or {}).get("shard")
    if not text:
        return None
    i, _, n = str(text).partition("/")
    try:
        return int(i), int(n)
    except ValueError:
        raise CompareInputError(f"{path}: shard {text!r}: expected I/N") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m conformance.suite.merge OUT SHARD_DIR [SHARD_DIR ...]", file=sys.stderr)
        return 2
    try:
        result = merge(Path(argv[0]), [Path(a) for a in argv[1:]])
    except UsageError as exc:  # a bad shard, or an OUT another run holds
        print(f"merge: error: {exc}", file=sys.stderr)
        return 2
    s = result.to_dict()["summary"]
    missing = result.metrics.get("missing_shards") or []
    print(f"merged {len(argv) - 1} shards into {argv[0]}: {s['passed']} passed, {s['failed']} failed, "
          f"{s['error']} errors, {s['skipped']} skipped, {s['not_run']} not run"
          + (f"; MISSING shards {', '.join(missing)}" if missing else ""))
    assert result.verdict is not None
    print(result.verdict.headline())
    return result.verdict.exit_code


if __name__ == "__main__":
    sys.exit(main())
