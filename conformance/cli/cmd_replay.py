"""``hybrid-conformance replay FILE``: re-execute a repro file.

Exit codes: 1 the recorded failure reproduces (the witness is printed), 0
nothing fails, 3 the replay fails otherwise than the file recorded (another
kind, or another message once numbers and ids are set aside), 2 the file is
malformed or cannot run here (the message names the field).  A replay that
times out reproduces only a recorded timeout: a timeout of a file that
recorded another failure (on a loaded machine, a short --timeout) neither
reproduces nor clears it, and is said so (exit 2)."""

from __future__ import annotations

import sys

from conformance.cli.common import call_timeout, path_arg
from conformance.errors import ReproFormatError, UsageError
from conformance.results.repro import load


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="re-execute a repro file; exit 1 if its failure reproduces "
                                                "(3: it fails otherwise)")
    p.add_argument("file", type=path_arg, help="a repro file (repros/<check>[--<mutant>].json or a scenario)")
    p.add_argument("--impl", default=None,
                   help="implementation to replay against (default: the file's, if it is a named adapter); "
                        "another implementation than the file's drops the file's mutant and faults")
    p.add_argument("--mutant", default=None, metavar="NAME|none",
                   help="apply this mutant instead of the file's; 'none' replays the clean implementation")
    p.add_argument("--no-faults", action="store_true", help="do not inject the file's environment faults")
    p.add_argument("--trust-impl", action="store_true",
                   help="allow importing a module:Class named inside the file (runs that module's code)")
    p.add_argument("--timeout", type=call_timeout, default=30.0, help="seconds an implementation call may take")
    p.add_argument("--quiet", action="store_true", help="print one line only")
    p.set_defaults(func=main)


def main(args) -> int:
    import torch

    from conformance.suite.replay import replay, same_failure, witness

    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add synchronization
    for flag, value in (("--impl", args.impl), ("--mutant", args.mutant)):
        if value is not None and not value.strip():  # "" would silently mean "the file's"
            raise UsageError(f"{flag} {value!r}: names nothing (leave the flag out for the file's)")

    try:
        repro = load(args.file)
        outcome = replay(repro, cli_impl=args.impl, cli_mutant=args.mutant, trust_impl=args.trust_impl,
                         use_faults=not args.no_faults, timeout=args.timeout)
    except ReproFormatError as exc:
        text = str(exc)  # load() names the file when it cannot read it; a field error does not
        raise UsageError(text if text.startswith(f"{args.file}:") else f"{args.file}: {text}") from None
    what = f"{outcome.impl}" + (f" + mutant {outcome.mutant}" if outcome.mutant else "") + \
           (f" + faults {','.join(outcome.faults)}" if outcome.faults else "")
    label = repro.title or repro.check or args.file.name
    for note in outcome.notes:
        print(f"note: {note}", file=sys.stderr)
    recorded = repro.failure.get("kind")
    if outcome.reproduced and outcome.kind == "timeout" and recorded != "timeout":
        at = f"at operation {outcome.failed_at + 1} of {len(repro.operations)}" if outcome.failed_at is not None \
            else "building the implementation"
        said = f"a failure of kind {recorded}" if recorded else "no failure kind"
        raise UsageError(f"{args.file}: the replay timed out {at} ({outcome.message.splitlines()[0][:160]}), but the "
                         f"file records {said}: not reproduced and not cleared; replay with a larger --timeout "
                         f"(now {args.timeout:g} s)")
    if outcome.reproduced and same_failure(repro, outcome):
        print(f"REPRODUCED: {label} on {what}")
        if not args.quiet:
            print(witness(repro, outcome))
        return 1
    if outcome.reproduced:
        print(f"FAILED OTHERWISE: {label} on {what}: the file records a {recorded} failure"
              + (f" ({_short(repro.failure.get('message'))})" if repro.failure.get("message") else "")
              + f"; this replay failed with {outcome.kind}: {_short(outcome.message)}")
        if not args.quiet:
            print(witness(repro, outcome))
        return 3
    print(f"not reproduced: {label} on {what} ({outcome.applied} operations applied, no failure)")
    return 0


def _short(message: str | None, n: int = 160) -> str:
    text = " ".join((message or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."
