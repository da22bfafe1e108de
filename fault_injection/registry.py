"""The registry of named mutants: what a mutant is and the decorator that
registers one.  It imports no mutant module (they import it); the catalogue
(:mod:`fault_injection.catalog`) loads them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: str  # SNAP, HIT, GROUPS, LIFETIME, HASH, ... (see upstream-bugs.md)
    description: str
    target: str  # the implementation it applies to: "reference", "vllm", ...
    apply: Callable  # factory -> factory with the bug
    # Implementation options the buggy code path needs (a tier, sub-block
    # matching...): runs of this mutant set them unless the user set them.
    options: tuple[tuple[str, object], ...] = ()
    # Not a bug but a patch of the engine (bug_class "FIX"): the id of the known defect whose cause it
    # removes (conformance.results.defects).  A run with it must say FIXED for that defect; the
    # mutants self-check never runs it (there is nothing to catch).
    fixes: str | None = None
    # The check family whose checks meet its code path (``"tier"``: a mutant of the
    # second tier), or None: every check of the profile.  The self-check runs only those.
    family: str | None = None

    def wrap(self, factory):
        return self.apply(factory)


MUTANTS: dict[str, Mutant] = {}


def register(name: str, bug_class: str, target: str = "reference", options: dict | None = None,
             fixes: str | None = None, family: str | None = None):
    """Decorator for a function ``factory -> factory``; its docstring is the description."""

    def deco(fn):
        MUTANTS[name] = Mutant(name, bug_class, (fn.__doc__ or "").strip(), target, fn,
                               tuple((options or {}).items()), fixes, family)
        return fn

    return deco


def subclass_mutant(base: type, factory, name: str, **methods):
    """The usual shape of a mutant of a class-based implementation: a subclass of
    ``factory`` (which must be ``base`` or derive from it) with ``methods`` replaced."""
    if not (isinstance(factory, type) and issubclass(factory, base)):
        raise TypeError(f"mutant {name} applies to the {getattr(base, 'name', base.__name__)} implementation only")
    return type(f"{factory.__name__}[{name}]", (factory,), methods)


def instance_mutant(name: str, apply: Callable, default_name: str):
    """A mutant that wraps each built instance (``apply(impl) -> impl``), for engines
    whose objects are patched at run time; the factory keeps the name, version, tier
    option, speculative option, option checks and warm-up of the one it wraps."""

    def wrap(factory):
        def built(config):
            return apply(factory(config))

        build: Any = built  # a factory that carries its implementation's name, version and tier option
        build.name = getattr(factory, "name", default_name)
        build.version = getattr(factory, "version", "unknown")
        build.tier_option = getattr(factory, "tier_option", None)
        build.spec_option = getattr(factory, "spec_option", None)
        # what a known defect's conditions are judged on is the engine's, mutant or not
        build.defect_facts = getattr(factory, "defect_facts", None)
        # and so are its option checks and one-time set-up (kept out of every call's timeout)
        build.validate_options = getattr(factory, "validate_options", None)
        build.warm_up = getattr(factory, "warm_up", None)
        build.__name__ = f"{getattr(factory, '__name__', default_name)}[{name}]"
        return build

    wrap.__doc__ = apply.__doc__
    return wrap
