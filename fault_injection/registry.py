"""The registry of named mutants: what a mutant is and the decorator that
registers one.  It imports no mutant module (they import it); the catalogue
(:mod:`fault_injection.catalog`) loads them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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

    def wrap(self, factory):
        return self.apply(factory)


MUTANTS: dict[str, Mutant] = {}


def register(name: str, bug_class: str, target: str = "reference", options: dict | None = None):
    """Decorator for a function ``factory -> factory``; its docstring is the description."""

    def deco(fn):
        MUTANTS[name] = Mutant(name, bug_class, (fn.__doc__ or "").strip(), target, fn,
                               tuple((options or {}).items()))
        return fn

    return deco
