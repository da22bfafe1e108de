"""Everything that can be wrong with a run's input, resolved before anything
runs, so that usage errors surface at once (exit code 2)."""

from __future__ import annotations

import math

from conformance.adapters import resolve
from conformance.errors import UsageError
from conformance.suite.checks import PROFILES, get_check
from conformance.suite.options import SHRINKS, RunOptions, default_model_config


def prepare(opts: RunOptions):
    """Resolve everything that can be wrong with the input before running
    anything, so that usage errors surface at once (exit code 2)."""
    if opts.profile not in PROFILES:
        raise UsageError(f"--profile {opts.profile!r}: expected one of {', '.join(PROFILES)}")
    _check_numbers(opts)
    for flag, value in (("--kv-blocks", opts.num_kv_blocks), ("--state-slots", opts.num_state_slots)):
        # The generator budgets at least 2 of each per request (HybridCacheMachine.fits).
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
            raise UsageError(f"{flag} {value}: must be an integer of at least 2 (the generator budgets "
                             f"ceil((prompt + new tokens) / B) + 1 blocks and 2 slots per request)")
    opts.impl_options = dict(opts.impl_options)  # defaults set below must not leak into the caller's dict
    factory = resolve(opts.impl)
    try:
        specs = [get_check(c) for c in opts.checks] if opts.checks else list(PROFILES[opts.profile].checks)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    name = getattr(factory, "name", opts.impl)
    # How this implementation turns its second tier on, if it has one (an
    # optional class attribute: ("option", value)).
    tier_option = getattr(factory, "tier_option", None)
    if opts.mutant:
        from fault_injection.catalog import get_mutant

        try:
            mutant = get_mutant(opts.mutant)
        except KeyError as exc:
            raise UsageError(f"--mutant: {exc.args[0]}") from None
        _check_mutant_target(mutant, opts.impl, factory)
        try:
            factory = mutant.wrap(factory)
        except TypeError as exc:
            raise UsageError(f"--mutant {opts.mutant}: {exc}") from None
        for key, value in mutant.options:  # the configuration the buggy code path needs
            opts.impl_options.setdefault(key, value)
    env = None
    if opts.faults:
        from fault_injection.environment import build_faults

        try:
            env = build_faults(opts.faults, opts.seed)
        except KeyError as exc:
            raise UsageError(f"--faults: {exc.args[0]}") from None
        if tier_option:
            # Transfer faults need transfers, which implementations issue only
            # through their second tier: injecting faults turns it on.
            opts.impl_options.setdefault(*tier_option)
    _check_impl_options(factory, specs, opts, tier_option)
    # One-time set-up an implementation may need before its first build (an
    # optional ``warm_up()`` class method), kept out of the first example's
    # per-call timeout: on a loaded machine it is a timeout, then a flaky pass.
    warm_up = getattr(factory, "warm_up", None)
    if callable(warm_up):
        warm_up()
    model_config = opts.model_config or default_model_config()
    return factory, name, specs, model_config, env


def _check_numbers(opts: RunOptions) -> None:
    for flag, value in (("--examples", opts.examples), ("--steps", opts.steps), ("--block-size", opts.block_size),
                        ("--workers", opts.workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{flag} {value!r}: must be an integer of at least 1")
    if opts.shrink not in SHRINKS:
        raise UsageError(f"--shrink {opts.shrink!r}: expected one of {', '.join(SHRINKS)}")
    t = opts.timeout
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
        raise UsageError(f"--timeout {t!r}: must be a finite number of seconds above 0")


def _check_mutant_target(mutant, impl: str, factory) -> None:
    """A mutant wraps the implementation it was written for: a vLLM mutant on
    the reference (or the reverse) would fail inside the run, or worse, test
    nothing."""
    from conformance.adapters.reference import ReferenceCache

    target = mutant.target.removesuffix("-spec")  # a mutant of speculative decoding wraps the implementation
    if target in ("reference", "reference-disagg"):  # the latter wraps the reference's disaggregated mode
        fits = isinstance(factory, type) and issubclass(factory, ReferenceCache)
        if not fits and target == "reference-disagg":
            from conformance.adapters.reference.disagg import ReferenceDisagg

            fits = isinstance(factory, type) and issubclass(factory, ReferenceDisagg)
    else:
        # "vllm-disagg" wraps the vLLM adapter's disaggregated mode (VllmCache.disagg_factory)
        target = target.removesuffix("-disagg")
        fits = impl == target or getattr(factory, "__module__", "").startswith(f"conformance.adapters.{target}")
    if not fits:
        raise UsageError(f"--mutant {mutant.name}: a mutant of the {mutant.target} implementation, not of "
                         f"--impl {impl}")


def _check_impl_options(factory, specs, opts: RunOptions, tier_option) -> None:
    """Options the implementation rejects (an interval that is not a multiple
    of the block size...) are the user's mistake: a usage error now, not an
    "error" verdict of every check.  An implementation says so through an
    optional ``validate_options(config)`` that raises ValueError."""
    validate = getattr(factory, "validate_options", None)
    if not callable(validate):
        return
    from conformance.suite.execute import check_impl_config

    for spec in specs:
        config = check_impl_config(spec, opts, tier_option, getattr(factory, "spec_option", None))
        try:
            validate(config)
        except ValueError as exc:
            raise UsageError(f"--option {config.options}: {exc} (check {spec.id})") from None


