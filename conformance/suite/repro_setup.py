"""What a replay of a repro file does before its first operation: the
implementation's set-up and its check of the file's options, and the checks'
observers the file's check judges with.  Its own module so that the known
defects' pinned replays (known.py) and the replay command (replay.py) share
them without importing each other."""

from __future__ import annotations

from conformance.errors import ReproFormatError
from conformance.results.repro import Repro
from conformance.suite.checks import get_check


def prepare_factory(factory, repro: Repro) -> None:
    """What a run does before its first example, done before the first
    operation: the implementation's one-time set-up (``warm_up``) and its
    check of the file's options (``validate_options``, which for vLLM builds
    the configurations the options need), both outside every call's timeout.
    Building vLLM's ModelConfig takes 30 s and more on a loaded machine: inside
    the first call it would be a timeout, not the recorded failure."""
    warm_up = getattr(factory, "warm_up", None)
    if callable(warm_up):
        warm_up()
    validate = getattr(factory, "validate_options", None)
    if callable(validate):
        try:
            validate(repro.impl_config)
        except ValueError as exc:
            raise ReproFormatError(f"impl_config.options: {exc}") from None


def observers_of(check_id: str) -> tuple[str, ...]:
    try:
        return get_check(check_id).observers
    except KeyError:  # a scenario file names no check of this suite: logits and invariants only
        return ()
