"""The registry of named faults.  Importing the package registers the
built-in mutants; adapters' mutant modules register theirs the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


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


def get_mutant(name: str) -> Mutant:
    _load_builtin()
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
    return MUTANTS[name]


def _load_builtin() -> None:
    from . import reference_mutants  # noqa: F401  (registers on import)
    from . import retention_mutants  # noqa: F401
    from . import vllm_mutants  # noqa: F401  (imports vLLM only when one is applied)
    from . import sglang_mutants  # noqa: F401  (imports SGLang only when one is applied)
