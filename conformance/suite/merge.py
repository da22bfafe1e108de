"""Merging the results of the shards of one run (``--shard i/n`` on several
CI runners) into one report directory: results.json, junit.xml, index.html
and repros/ (paths rewritten to the merged copies).

    python -m conformance.suite.merge OUT SHARD_DIR [SHARD_DIR ...]
"""

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
    merged = result_from_dict(first)
    merged.checks, merged.faults = [], {}
    # Held, and what an earlier merge (or run) left there cleared, before anything is copied in (a lock
    # left by a merge that raised below is taken over: its process is gone).
    reports = ReportDir(out).open()
    (out / "repros").mkdir(exist_ok=True)
    seen = set()
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
        merged.not_run += part.not_run
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
    merged.checks.sort(key=lambda c: _ORDER.get(c.id, len(_ORDER)))
    merged.metrics = {"merged_from": [str(p) for p in dirs]}
    reports.write(merged)
    reports.close()
    return merged


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
    print(f"merged {len(argv) - 1} shards into {argv[0]}: {s['passed']} passed, {s['failed']} failed, "
          f"{s['error']} errors, {s['skipped']} skipped" + (" (interrupted)" if result.interrupted else "")
          + ("; nothing was checked" if not result.checked else ""))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
