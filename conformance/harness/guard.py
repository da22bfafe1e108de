"""Calls into an implementation, so that a raise or a hang becomes a finding.

A hang is cut with SIGALRM (only possible on the main thread of a Unix
process; elsewhere calls run without a deadline)."""

from __future__ import annotations

import signal
import threading
import traceback

from conformance.errors import ImplementationError


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def guarded(what: str, fn, *args, timeout: float | None = None):
    use_alarm = bool(timeout) and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if use_alarm and timeout:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(*args)
    except _Timeout:
        raise ImplementationError("timeout", f"{what} did not return within {timeout:g} s") from None
    except ImplementationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any exception of the implementation is a finding
        tb = traceback.format_exception(exc)
        raise ImplementationError("raised", f"{what} raised {type(exc).__name__}: {exc}\n" + "".join(tb[-3:])) from exc
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
