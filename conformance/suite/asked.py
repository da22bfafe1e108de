"""What the implementation says about itself before a check (its real block
size, the engine configuration it was started with, its retention policy),
each asked under the run's timeout.  Its own module so that the single-worker
and the disaggregated checks both ask here without importing each other."""

from __future__ import annotations

from dataclasses import replace

from conformance.errors import ImplementationError
from conformance.harness.guard import guarded


class Hung(Exception):
    """Asking the implementation before the check hung: the check reports it and calls it no more."""

    def __init__(self, error: ImplementationError):
        super().__init__(str(error))
        self.error = error


def ask(what: str, fn, *args, timeout: float | None):
    """A guarded call before the check; a hang ends the check (:class:`Hung`)."""
    try:
        return guarded(what, fn, *args, timeout=timeout)
    except ImplementationError as exc:
        if exc.kind == "timeout":
            raise Hung(exc) from None
        raise


def real_block_size(factory, impl_config, timeout: float | None, impl=None):
    """The configuration with the block size the implementation really uses
    (``layout()``: an engine may raise the one asked for, as vLLM raises a
    hybrid model's attention block to hold a Mamba page), so that the
    generator draws prompt lengths and budgets around the real blocks.  The
    same configuration when it keeps the block size asked for.  ``impl``: an
    instance built with ``impl_config`` already (built here otherwise)."""
    try:
        impl = impl or ask("building the implementation", factory, impl_config, timeout=timeout)
        block_size = ask("layout()", impl.layout, timeout=timeout).block_size
    except ImplementationError:
        return impl_config  # the check builds it again and reports the error, with context
    return impl_config if block_size == impl_config.block_size else replace(impl_config, block_size=block_size)


UNKNOWN = object()  # building the implementation failed: the check reports it itself


def engine_config(factory, impl_config, timeout: float | None, impl=None) -> dict:
    """What the implementation, built with this configuration, says it was
    started with (optional ``engine_config()``, see conformance/contract.py);
    empty when it says nothing or cannot be built (the check reports that).
    ``impl``: an instance built with ``impl_config`` already (built here otherwise)."""
    if isinstance(factory, type) and not callable(getattr(factory, "engine_config", None)):
        return {}
    try:
        impl = impl or ask("building the implementation", factory, impl_config, timeout=timeout)
        describe = getattr(impl, "engine_config", None)
        return dict(ask("engine_config()", describe, timeout=timeout)) if callable(describe) else {}
    except ImplementationError:
        return {}


def declared_retention(factory, impl_config, timeout: float | None, impl=None):
    """The retention policy the implementation, built with this
    configuration, declares (an engine may declare one for some settings
    only): a dict, None when it declares none, ``UNKNOWN`` when it could
    not be asked.  ``impl``: an instance built with ``impl_config`` already."""
    if isinstance(factory, type) and not callable(getattr(factory, "retention", None)):
        return None
    try:
        impl = impl or ask("building the implementation", factory, impl_config, timeout=timeout)
        retention = getattr(impl, "retention", None)
        return ask("retention()", retention, timeout=timeout) if callable(retention) else None
    except ImplementationError:
        return UNKNOWN  # the check itself builds it again and reports the error, with context
