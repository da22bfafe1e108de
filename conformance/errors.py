"""Every exception the harness raises, in one place, by who is at fault.

- The implementation under test: :class:`ContractError` (it broke the contract),
  :class:`ConformanceFailure` (a wrong result or a broken invariant, found by a
  checker), :class:`ImplementationError` (it raised or hung).  These are findings:
  they become a failed or errored check, never a crash of the harness.
- The engine under test (engine level): :class:`EngineError`.
- The environment, on purpose: :class:`TransferFailed` (a fault made a transfer fail).
- The user: :class:`UsageError` and its kinds (exit code 2, one line).
- The harness itself: :class:`HarnessError` (a checker crashed: never a pass).
"""

from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    """How a check failed.  A ``str``: each compares equal to, and is written
    to JSON as, its value (results.json, repro files and expectations files
    keep the strings)."""

    LOGITS = "logits"  # a computed logit differs from the no-cache reference
    INVARIANT = "invariant"  # a broken invariant of the memory or the bookkeeping (lifetime: leaks)
    CONTRACT = "contract"  # a plan or view that breaks the contract
    STALL = "stall"  # no progress while requests are active
    RETENTION = "retention"  # a state cached where the declared policy does not allow it
    HIT_RATE = "hit-rate"  # reuse below what the declared policy promises (logits right)
    COVERAGE = "coverage"  # the check's situation never occurred
    NOISE = "noise"  # an engine check too noisy to judge
    RAISED = "raised"  # the implementation raised
    TIMEOUT = "timeout"  # the implementation did not return in time
    HARNESS = "harness"  # the harness itself crashed: never a pass
    # the implementation failed, and the same operations replayed did not fail again: it does not repeat
    # itself (it iterates a set of objects hashed by address, reads a clock, draws at random...)
    NONDETERMINISTIC = "nondeterministic"


class ContractError(Exception):
    """An implementation broke the contract (bad ids, impossible ranges...).

    Raised by the harness; it is a conformance failure, not a usage error.
    """


class ConformanceFailure(Exception):
    """The implementation produced a wrong result or broke an invariant."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = FailureKind(kind)


class ImplementationError(Exception):
    """The implementation raised or hung: a conformance finding (status error)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = FailureKind(kind)  # raised | timeout


class Abandoned(BaseException):  # noqa: N818 - not an error of its own: it carries one
    """The implementation hung (``error``, an :class:`ImplementationError` of
    kind ``timeout``): the check abandons it at once.  A ``BaseException`` so
    that Hypothesis passes it straight through instead of replaying the
    failing example (which would wait out the timeout again); no later phase
    of the check calls the implementation again (no minimizing replays)."""

    def __init__(self, error: ImplementationError):
        super().__init__(str(error))
        self.error = error


class HarnessError(Exception):
    """The harness itself failed (a checker crashed, a transport broke): the
    check reports an error naming the harness, never a pass."""


class EngineError(Exception):
    """The engine failed a call: raised, crashed or hung.  A defect of the
    engine under test, reported as a check result, never a harness crash."""

    def __init__(self, kind: str, message: str, log_tail: str = ""):
        super().__init__(message)
        self.kind = kind  # raised | crashed | timeout | startup
        self.message = message
        self.log_tail = log_tail


class TransferFailed(Exception):
    """Raised by a transport fault hook: the transfer reports failure."""


class UsageError(Exception):
    """Bad input from the user (exit code 2)."""


class CompareInputError(UsageError, ValueError):
    """An input file of ``compare`` is missing or not what it should be."""


class ReproFormatError(UsageError, ValueError):
    """The file is not a valid repro; the message starts with the field path."""
