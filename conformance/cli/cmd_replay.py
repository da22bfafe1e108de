"""``hybrid-conformance replay FILE``: re-execute a repro file.

Exit codes: 1 the recorded failure reproduces (the witness is printed), 0
nothing fails, 3 the replay fails otherwise than the file recorded (another
kind, or another message once numbers and ids are set aside), 2 the file is
malformed or cannot run here (the message names the field).  A replay that
times out reproduces only a recorded timeout: a timeout of a file that
recorded another failure (on a loaded machine, a short --timeout) neither
reproduces nor clears it, and is said so (exit 2).

A ``nondeterministic`` repro (an implementation that failed once and not
when Hypothesis ran the same operations again) cannot be expected to fail on
one replay: it is replayed ``--runs`` times (default 5), each in a fresh
session, and the runs are compared.  Exit 1 when they still end differently
(one fails, another does not, or fails otherwise: the recorded failure kind,
met again) or every run fails with the recorded first failure; 3 when every
run fails alike with another failure; 0 when every run passes (said, with
whether their plans still differ: a failure may then need more runs)."""

from __future__ import annotations

import sys

from conformance.cli.common import call_timeout, path_arg, positive_int
from conformance.errors import FailureKind, ReproFormatError, UsageError
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
    p.add_argument("--runs", type=positive_int, default=5,
                   help="replays of a nondeterministic repro, compared with one another (default 5); a repro of "
                        "another kind replays once: the harness is deterministic")
    p.add_argument("--quiet", action="store_true", help="print one line only")
    p.set_defaults(func=main)


def main(args) -> int:
    import torch

    from conformance.suite.replay import replay, replay_repeatedly, same_failure, witness

    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add synchronization
    for flag, value in (("--impl", args.impl), ("--mutant", args.mutant)):
        if value is not None and not value.strip():  # "" would silently mean "the file's"
            raise UsageError(f"{flag} {value!r}: names nothing (leave the flag out for the file's)")

    how = dict(cli_impl=args.impl, cli_mutant=args.mutant, trust_impl=args.trust_impl, use_faults=not args.no_faults,
               timeout=args.timeout)
    try:
        repro = load(args.file)
        if repro.failure.get("kind") == FailureKind.NONDETERMINISTIC:
            return _nondeterministic(args, repro, replay_repeatedly(repro, args.runs, **how))
        outcome = replay(repro, **how)
    except ReproFormatError as exc:
        text = str(exc)  # load() names the file when it cannot read it; a field error does not
        raise UsageError(text if text.startswith(f"{args.file}:") else f"{args.file}: {text}") from None
    what = f"{outcome.impl}" + (f" + mutant {outcome.mutant}" if outcome.mutant else "") + \
           (f" + faults {','.join(outcome.faults)}" if outcome.faults else "")
    label = repro.title or repro.check or args.file.name
    for note in outcome.notes:
        print(f"note: {note}", file=sys.stderr)
    recorded = repro.failure.get("kind")
    _timed_out(args, repro, outcome, recorded)
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


def _timed_out(args, repro, outcome, recorded: str | None) -> None:
    """A replay that timed out where the file records another failure (on a loaded machine, a short
    --timeout) neither reproduces nor clears it: exit 2, said."""
    if not (outcome.reproduced and outcome.kind == "timeout" and recorded != "timeout"):
        return
    at = f"at operation {outcome.failed_at + 1} of {len(repro.operations)}" if outcome.failed_at is not None \
        else "building the implementation"
    said = f"a failure of kind {recorded}" if recorded else "no failure kind"
    raise UsageError(f"{args.file}: the replay timed out {at} ({outcome.message.splitlines()[0][:160]}), but the "
                     f"file records {said}: not reproduced and not cleared; replay with a larger --timeout "
                     f"(now {args.timeout:g} s)")


def _nondeterministic(args, repro, rep) -> int:
    """A nondeterministic repro's runs, compared: what the kind records is a failure that the same
    operations do not repeat, so the runs reproduce it by ending differently (module docstring)."""
    from conformance.suite.replay import witness

    first = rep.outcomes[0]
    what = f"{first.impl}" + (f" + mutant {first.mutant}" if first.mutant else "") + \
           (f" + faults {','.join(first.faults)}" if first.faults else "")
    label = repro.title or repro.check or args.file.name
    for note in first.notes:
        print(f"note: {note}", file=sys.stderr)
    kind = rep.recorded[0] if rep.recorded else None
    for o in rep.outcomes:
        _timed_out(args, repro, o, kind)
    n, ops = len(rep.outcomes), len(repro.operations)
    failed = [o for o in rep.outcomes if o.reproduced]
    recurred = [o for o in failed if rep.recurred(o)]
    tally = f"{len(failed)} of {n} run{'s' if n > 1 else ''} failed" \
        + (f", {len(recurred)} with its first failure ({kind})" if kind else "")
    differ = rep.outcomes_differ()
    runs = f"{n} runs of its {ops} operations" if n > 1 else \
        f"1 run of its {ops} operations (--runs 1: none to compare)"
    if differ or (recurred and len(recurred) == n):
        how = f"it still does not repeat itself: {differ}" if differ else \
            f"its first failure ({kind}) recurred" + (" in every run, which ended alike" if n > 1 else "")
        print(f"REPRODUCED: {label} on {what}: {runs}: {how}; {tally}")
        if not args.quiet and failed:
            print(witness(repro, _tail((recurred or failed)[0])))
        return 1
    if failed:  # every run failed alike, not with the first failure the file records
        print(f"FAILED OTHERWISE: {label} on {what}: the file records a nondeterministic failure"
              + (f" first met as {kind} ({_short(rep.recorded[1])})" if rep.recorded else "")
              + f"; {runs}: each failed alike, with {failed[0].kind}: {_short(failed[0].message)}")
        if not args.quiet:
            print(witness(repro, _tail(failed[0])))
        return 3
    plans = rep.plans_differ()
    print(f"not reproduced: {label} on {what}: {runs}: " + ("each passed" if n > 1 else "it passed")
          + (f"; but {plans}: it still does not repeat itself, and more runs (--runs) may meet the failure"
             if plans else (", and planned alike" if n > 1 else "")))
    return 0


def _tail(outcome):
    """A run as its witness shows it: the tail of its history (the runs kept all of it, to compare plans)."""
    from dataclasses import replace

    return replace(outcome, events=outcome.events[-12:])


def _short(message: str | None, n: int = 160) -> str:
    text = " ".join((message or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."
