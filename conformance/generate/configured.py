"""Rules whose strategies depend on the configuration, and the binding that
makes them plain Hypothesis rules.

A rule's draws need the block size, the vocabulary and the check's sizes;
Hypothesis reads rules (and their strategies) from the class.  So a rule is
declared with :func:`configured_rule` (each argument a function of a
:class:`Conf`), and :func:`bind` makes, for one configuration, a subclass
whose rules carry concrete strategies: draws, shrinking and replay exactly as
written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from conformance.generate.spec import CheckSpec


class ExampleStopped(Exception):
    """Raised by a machine's ``apply`` once a known defect ended the example
    (the session may be corrupt: nothing more is applied).  The rule it
    interrupts ends there, quietly (:func:`bind`): what follows in it would
    only read a session that did not apply its operations."""


def _ends_when_stopped(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except ExampleStopped:
            return None

    return run


@dataclass(frozen=True)
class Conf:
    """What the rules' strategies depend on: the check, the block size, the vocabulary."""

    spec: CheckSpec
    B: int
    vocab: int
    num_kv_blocks: int

    @property
    def max_len(self) -> int:
        return self.spec.max_seq_blocks * self.B


def configured_rule(precondition: Callable | None = None, first: bool = False,
                    **arguments: Callable[[Conf], st.SearchStrategy]):
    """A rule whose argument strategies depend on the configuration: each
    ``arguments`` value maps a :class:`Conf` to a strategy.  The machine binds
    them when it is built for a configuration, so Hypothesis sees plain rules
    with concrete strategies (draws, shrinking and replay exactly as written).
    ``first``: an ``@initialize`` rule (runs once, before the others)."""

    def deco(fn):
        fn._configured = (precondition, first, arguments)
        return fn

    return deco




def bind(cls: type, conf: Conf, mixins: tuple[type, ...] = ()) -> type:
    """The subclass of ``cls`` (with the rule groups ``mixins`` added) whose
    configured rules draw for ``conf``."""
    attrs: dict = {"conf": conf}
    composite = type(cls.__name__, (cls, *mixins), {}) if mixins else cls
    for klass in reversed(composite.__mro__):
        for name, fn in vars(klass).items():
            if hasattr(fn, "_configured"):
                pre, first, arguments = fn._configured
                decorate = initialize if first else rule
                bound = decorate(**{k: make(conf) for k, make in arguments.items()})(_ends_when_stopped(fn))
                attrs[name] = precondition(pre)(bound) if pre is not None else bound
    return type(f"{cls.__name__}[{conf.spec.id}]", (composite,), attrs)
