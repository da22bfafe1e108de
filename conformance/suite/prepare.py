"""Everything that can be wrong with a run's input, resolved before anything
runs, so that usage errors surface at once (exit code 2)."""

from __future__ import annotations

from conformance.adapters import resolve
from conformance.errors import UsageError
from conformance.suite.checks import PROFILES, get_check
from conformance.suite.options import RunOptions, default_model_config


def prepare(opts: RunOptions):
    """Resolve everything that can be wrong with the input before running
    anything, so that usage errors surface at once (exit code 2)."""
    if opts.profile not in PROFILES:
        raise UsageError(f"--profile {opts.profile!r}: expected one of {', '.join(PROFILES)}")
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
    # One-time set-up an implementation may need before its first build (an
    # optional ``warm_up()`` class method), kept out of the first example's
    # per-call timeout: on a loaded machine it is a timeout, then a flaky pass.
    warm_up = getattr(factory, "warm_up", None)
    if callable(warm_up):
        warm_up()
    model_config = opts.model_config or default_model_config()
    return factory, name, specs, model_config, env


