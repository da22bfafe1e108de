"""The one function that makes a :class:`~conformance.suite.prepared.Run`
from the user's options.  Everything that can be wrong with the input is
found here, before anything runs, so that usage errors surface at once
(exit code 2, one line) and no report directory is touched for them."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from conformance.adapters import ENGINE_LEVEL, resolve
from conformance.errors import UsageError
from conformance.suite.checks import CATALOGUE, PROFILES, get_check
from conformance.suite.config_matrix import expand
from conformance.suite.options import SHRINKS, RunOptions, default_model_config, default_report_dir, timeout_problem
from conformance.suite.prepared import PlannedCheck, PoolSizes, Run
from conformance.suite.seeds import seed_index


def prepare_run(opts: RunOptions) -> Run:
    """Resolve the implementation, the mutant, the faults, the checks and their
    variants, seeds and shard, and the report directory; raise UsageError for
    anything wrong with them.  ``--impl vllm-engine`` makes an engine-level
    Run (conformance.suite.engine_level)."""
    _check_names(opts)
    if isinstance(opts.impl, str) and opts.impl in ENGINE_LEVEL:
        from conformance.suite.engine_level import plan_engine, prepare_engine

        plan = plan_engine(opts)  # a flag it would ignore, a profile, option or check it does not have: now
        if opts.report_dir is not None and opts.write_reports:
            check_report_dir(opts.report_dir)
        return prepare_engine(opts, plan)
    if opts.profile not in PROFILES:
        raise UsageError(f"--profile {opts.profile!r}: expected one of {', '.join(PROFILES)}")
    profile = PROFILES[opts.profile]
    _check_numbers(opts)
    if opts.report_dir is not None and opts.write_reports:
        check_report_dir(opts.report_dir)
    impl, factory = _resolve_impl(opts.impl)
    known_as = _named(impl, factory)  # the name an expectations file knows it by
    try:
        # a check named twice runs once (dict.fromkeys keeps the order asked)
        specs = [get_check(c) for c in dict.fromkeys(opts.checks)] if opts.checks else list(profile.checks)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    name = str(getattr(factory, "name", impl))
    # How this implementation turns its second tier on, if it has one (an
    # optional class attribute: ("option", value)).
    tier_option = getattr(factory, "tier_option", None)
    impl_options = dict(opts.impl_options)  # the defaults set below never leak into the caller's dict
    if opts.mutant:
        factory = _apply_mutant(opts.mutant, impl, factory, impl_options)
    if opts.faults:
        _check_faults(opts.faults, opts.seed)
        if tier_option:
            # Transfer faults need transfers, which implementations issue only
            # through their second tier: injecting faults turns it on.
            impl_options.setdefault(*tier_option)
    # How it turns speculative decoding on (an optional class attribute, of the
    # implementation a mutant wraps too): the spec family runs with it.
    spec_option = getattr(factory, "spec_option", None)
    pools = PoolSizes(opts.block_size, opts.num_kv_blocks, opts.num_state_slots)
    model_config = opts.model_config or default_model_config()
    _check_sizes(model_config, specs, impl_options, pools, tier_option, spec_option)
    _check_impl_options(factory, specs, impl_options, pools, tier_option, spec_option)
    planned = plan_checks(specs, factory, impl_options, opts.matrix)
    # The engine version's (and build's) known defects: a bad entry is a usage error now, before any check runs.
    from conformance.suite.known import check_expectations_engine, check_fix_target, expectations_for

    expectations = expectations_for(known_as, str(getattr(factory, "version", "unknown")), opts.expectations,
                                    build=str(getattr(factory, "build", "") or ""))
    if opts.expectations is not None and expectations is not None:
        check_expectations_engine(expectations.doc, expectations.path, known_as, name,
                                  str(getattr(factory, "build", "") or ""))
    check_fix_target(opts.mutant, expectations)
    unsplit = tuple(spec.id for _, spec in planned)
    if opts.shard:
        planned = select_shard(planned, *opts.shard)
        if not planned:  # a green run of nothing would hide a miscounted CI matrix
            raise UsageError(f"--shard {opts.shard[0]}/{opts.shard[1]}: this shard holds no check (the run "
                             f"selects {len(specs)}); use at most {len(specs)} shards")
    # One-time set-up an implementation may need before its first build (an
    # optional ``warm_up()`` class method), kept out of the first example's
    # per-call timeout: on a loaded machine it is a timeout, then a flaky pass.
    warm_up = getattr(factory, "warm_up", None)
    if callable(warm_up):
        warm_up()
    report_dir = None
    if opts.write_reports:
        # Reserved last: a usage error above leaves no directory behind.
        report_dir = Path(opts.report_dir) if opts.report_dir is not None else \
            default_report_dir(impl, opts.seed, opts.mutant, opts.faults)
    return Run(impl=impl, factory=factory, name=name, version=str(getattr(factory, "version", "unknown")),
               profile=profile, seed=opts.seed,
               checks=tuple(PlannedCheck(k, index, spec) for k, (index, spec) in enumerate(planned)),
               selected=len(specs), impl_options=impl_options, tier_option=tier_option, spec_option=spec_option,
               mutant=opts.mutant,
               faults=tuple(opts.faults), model_config=model_config,
               examples=opts.examples or profile.examples, examples_asked=opts.examples,
               hypothesis_steps=opts.steps or profile.hypothesis_steps, timeout=opts.timeout, shrink=opts.shrink,
               pools=pools,
               report_dir=report_dir, workers=opts.workers, shard=opts.shard, stop_at_failure=opts.stop_at_failure,
               matrix=opts.matrix, options=replace(opts, impl_options=dict(opts.impl_options)),
               expectations=expectations, unsplit=unsplit)


def plan_checks(specs, factory, impl_options, matrix: bool = True) -> list:
    """``[(seed index, spec)]`` of ``specs``, each expanded under the
    implementation's configuration matrix (variants keep their check's index)."""
    planned = [(seed_index(CATALOGUE, spec.id), spec) for spec in specs]
    return expand(planned, factory, dict(impl_options)) if matrix else planned


def planned_check(run: Run, check_id: str) -> PlannedCheck:
    """The entry of ``run``'s plan for ``check_id``; a check (or variant) the
    plan does not hold is planned after it, with the seed it has everywhere."""
    for p in run.checks:
        if p.id == check_id:
            return p
    try:
        spec = get_check(check_id)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    return PlannedCheck(len(run.checks), seed_index(CATALOGUE, check_id), spec)


def select_shard(planned: list, i: int, n: int) -> list:
    """Round-robin share ``i`` of ``n`` (1-based) of ``[(index, spec)]``:
    every check lands in exactly one shard, and neighbouring checks (which
    tend to cost alike) spread over the runners."""
    if not (isinstance(i, int) and isinstance(n, int) and 1 <= i <= n):
        raise UsageError(f"--shard {i}/{n}: expected i/n with 1 <= i <= n")
    return [item for k, item in enumerate(planned) if k % n == i - 1]


def impl_label(factory) -> str:
    """``module:Class`` for an implementation given as an object (replay needs it as ``--impl``)."""
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"


def _named(impl: str, factory) -> str:
    """A named adapter's class given as an object (``machine_test(VllmCache)``,
    the plugin's fixture) is that adapter for its expectations file: its
    name, not ``module:Class``.  Only an adapter already imported can be it."""
    import sys

    from conformance.adapters import NAMED

    for name, target in NAMED.items():
        module, _, attr = target.partition(":")
        if getattr(sys.modules.get(module), attr, None) is factory:
            return name
    return impl


def _resolve_impl(impl) -> tuple[str, Callable[..., Any]]:
    if isinstance(impl, str):
        return impl, resolve(impl)
    if not callable(impl):
        raise UsageError(f"impl {impl!r}: expected a name (reference, vllm, module:Class) or a factory")
    return impl_label(impl), impl


def _apply_mutant(name: str, impl: str, factory, impl_options: dict):
    from fault_injection.catalog import get_mutant

    try:
        mutant = get_mutant(name)
    except KeyError as exc:
        raise UsageError(f"--mutant: {exc.args[0]}") from None
    check_mutant_target(mutant, impl, factory)
    try:
        wrapped = mutant.wrap(factory)
    except TypeError as exc:
        raise UsageError(f"--mutant {name}: {exc}") from None
    for key, value in mutant.options:  # the configuration the buggy code path needs
        impl_options.setdefault(key, value)
    return wrapped


def _check_faults(names: tuple[str, ...], seed: int) -> None:
    from fault_injection.environment import build_faults

    try:
        build_faults(tuple(names), seed)
    except KeyError as exc:
        raise UsageError(f"--faults: {exc.args[0]}") from None


def _check_names(opts: RunOptions) -> None:
    """Names given empty (an unset variable in a CI script: ``--mutant "$M"``)
    would silently mean "none"; a fault list that names nothing (``--faults ,``)
    or an empty name in it (a fault named twice: ``build_faults`` refuses it)."""
    for flag, value in (("--mutant", opts.mutant), ("--expectations", opts.expectations)):
        if value is not None and not str(value).strip():
            raise UsageError(f"{flag} {str(value)!r}: names nothing (leave the flag out for none)")
    for name in opts.checks:
        if not str(name).strip():
            raise UsageError(f"--check {name!r}: names no check")
    faults = list(opts.faults)
    if any(not str(f).strip() for f in faults):
        raise UsageError(f"--faults {','.join(faults)!r}: an empty fault name; expected NAME[,NAME...] "
                         f"(leave the flag out for no fault)")


def _check_numbers(opts: RunOptions) -> None:
    for flag, value in (("--examples", opts.examples), ("--steps", opts.steps), ("--block-size", opts.block_size),
                        ("--workers", opts.workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{flag} {value!r}: must be an integer of at least 1")
    for flag, value in (("--kv-blocks", opts.num_kv_blocks), ("--state-slots", opts.num_state_slots)):
        # The generator budgets at least 2 of each per request (HybridCacheMachine.fits).
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
            raise UsageError(f"{flag} {value}: must be an integer of at least 2 (the generator budgets "
                             f"ceil((prompt + new tokens) / B) + 1 blocks and 2 slots per request)")
    if opts.shrink not in SHRINKS:
        raise UsageError(f"--shrink {opts.shrink!r}: expected one of {', '.join(SHRINKS)}")
    why = timeout_problem(opts.timeout) if opts.timeout is not None else None
    if why:
        raise UsageError(f"--timeout {opts.timeout!r}: {why}")


def check_report_dir(path: Path | str, flag: str = "--report-dir", who: str | None = None) -> None:
    """A report directory that cannot be one is a usage error now, not a
    traceback (or a lost result) after the first check: an empty name (which
    would mean the current directory), a name the file system refuses (a
    component over 255 bytes), a regular file, a path under a file, a
    directory this user cannot write.  ``who``: how the message names it
    (default ``"<flag> <path>:"``)."""
    if not str(path).strip():
        raise UsageError(f"{flag} {str(path)!r}: names no directory (for the current directory, say '.')")
    path = Path(path)
    who = who or f"{flag} {_shown(path)}:"
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{who} is a file, not a directory")
        existing = path
        while not existing.exists():
            if existing.parent == existing:
                break
            existing = existing.parent
    except OSError as exc:  # a name too long, a loop of symbolic links
        raise UsageError(f"{who} cannot be a directory: {exc.strerror or exc}") from None
    if existing.exists() and not existing.is_dir():
        raise UsageError(f"{who} {_shown(existing)} is a file, so no directory can be made under it")
    limit = _name_max(existing)
    too_long = [part for part in path.parts if len(os.fsencode(part)) > limit]
    if too_long:
        raise UsageError(f"{who} a name of {len(os.fsencode(too_long[0]))} bytes, over the file system's {limit}")
    if existing.exists():
        import tempfile

        try:  # a real write, not a permission bit: root, read-only mounts and /proc answer differently
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".hcc-write-test-")
        except OSError as exc:
            what = "is not writable" if existing == path else f"cannot be made: {existing} is not writable"
            raise UsageError(f"{who} {what} ({exc.strerror or exc})") from None
        os.close(fd)
        os.unlink(probe)


def check_output_file(path: Path | str, flag: str, inputs: tuple = ()) -> None:
    """A file the command will write (``--html FILE``, ``--plot FILE``): a usage
    error now, before any work, when it names nothing, is a directory, has a
    name the file system refuses, lies where its directory cannot be made or
    written (checked as a report directory is), or is one of the command's
    ``inputs`` (a results.json, or a report directory's: it would be overwritten)."""
    if not str(path).strip():
        raise UsageError(f"{flag} {str(path)!r}: names no file")
    path = Path(path)
    for given in inputs:
        given = Path(given)
        try:
            same = path.resolve() in (given.resolve(), given.resolve() / "results.json")
        except OSError:
            continue
        if same:
            raise UsageError(f"{flag} {_shown(path)}: is one of the inputs ({_shown(given)}); it would be overwritten")
    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise UsageError(f"{flag} {_shown(path)}: cannot be written: {exc.strerror or exc}") from None
    if is_dir:
        raise UsageError(f"{flag} {_shown(path)}: is a directory, not a file")
    check_report_dir(path.parent, flag, who=f"{flag} {_shown(path)}: its directory {_shown(path.parent)}:")
    limit = _name_max(path.parent)
    if len(os.fsencode(path.name)) > limit:
        raise UsageError(f"{flag} {_shown(path)}: a name of {len(os.fsencode(path.name))} bytes, over the file "
                         f"system's {limit}")


def _name_max(directory: Path) -> int:
    """The longest name (bytes) a component may have on ``directory``'s file system (255 on Linux's)."""
    try:
        return os.pathconf(directory if directory.is_dir() else "/", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _shown(path: Path, n: int = 100) -> str:
    """A path as a message shows it: a name of thousands of characters is cut (the line stays readable)."""
    text = str(path)
    return text if len(text) <= n else f"{text[:n // 2]}...{text[-n // 2:]} ({len(text)} characters)"


def check_mutant_target(mutant, impl: str, factory, who: str | None = None, said: str | None = None) -> None:
    """A mutant wraps the implementation it was written for: a vLLM mutant on
    the reference (or the reverse) would fail inside the run, or worse, test
    nothing.  ``who`` and ``said``: how the message names the mutant
    (``--mutant NAME``) and the implementation (``--impl X``)."""
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
        raise UsageError(f"{who or f'--mutant {mutant.name}'}: a mutant of the {mutant.target} implementation, "
                         f"not of {said or f'--impl {impl}'}")


def _check_sizes(model_config, specs, impl_options: dict, pools: PoolSizes, tier_option, spec_option) -> None:
    """A model the harness cannot build, pools it cannot allocate, a block size
    the generator cannot draw prompts for: usage errors now, not a crash, a
    timeout building the implementation or a harness error in every check."""
    from conformance.suite.execute import check_impl_config
    from conformance.suite.limits import memory_problem, model_problem, prompt_problem

    why = model_problem(model_config)
    if why:
        raise UsageError(f"the model: {why}")
    asked = " ".join(f"{flag} {value}" for flag, value in (("--block-size", pools.block_size),
                                                            ("--kv-blocks", pools.num_kv_blocks),
                                                            ("--state-slots", pools.num_state_slots))
                     if value is not None)
    if not asked:
        return  # the checks' own sizes
    for spec in specs:
        config = check_impl_config(spec, impl_options, pools, tier_option, spec_option)
        why = memory_problem(model_config, config.block_size, config.num_kv_blocks, config.num_state_slots) or \
            prompt_problem(model_config.vocab_size, config.block_size, spec.max_prompt_blocks)
        if why:
            raise UsageError(f"{asked}: {why} (check {spec.id})")


def _check_impl_options(factory, specs, impl_options: dict, pools: PoolSizes, tier_option, spec_option) -> None:
    """Options the implementation rejects (an interval that is not a multiple
    of the block size...) are the user's mistake: a usage error now, not an
    "error" verdict of every check.  An implementation says so through an
    optional ``validate_options(config)`` that raises ValueError."""
    validate = getattr(factory, "validate_options", None)
    if not callable(validate):
        return
    from conformance.suite.execute import check_impl_config

    for spec in specs:
        config = check_impl_config(spec, impl_options, pools, tier_option, spec_option)
        try:
            validate(config)
        except ValueError as exc:
            raise UsageError(f"--option {config.options}: {exc} (check {spec.id})") from None
