"""Calls into an implementation, so that a raise or a hang becomes a finding.

A hang is cut with SIGALRM (only possible on the main thread of a Unix
process; elsewhere calls run without a deadline).  A timer already running
(pytest-timeout's, in a user's pytest run) keeps running: the call's alarm
is set to whichever comes first, and the outer timer fires as it would have,
re-armed for what is left of it after the call.

``SystemExit`` and ``KeyboardInterrupt`` raised by the implementation (a
``sys.exit()`` in ``schedule()``, a library that raises on a condition it
mistakes for Ctrl-C) are the implementation's failure, never the run's end:
only a signal that really arrived during the call (the user's Ctrl-C, a CI's
SIGTERM) stops the run.  The two are told apart by the signal handlers, which
record each signal before delegating to the handler they replace.

Handlers are read and set through ``_signal``, the C module under ``signal``:
``signal.signal`` and ``signal.getsignal`` convert every handler to a
``Handlers`` member, and for a callable (ours, and pytest's or the CLI's)
that conversion raises and catches a ValueError each time, about 8 us a
call.  A guarded call sets and reads handlers ten times, and a quick profile
makes about 60,000 guarded calls: about 5% of its time went there.  The C
functions take and return the same handlers (``SIG_DFL`` and ``SIG_IGN`` as
plain ints, equal to the enum members), so what is installed is the same."""

from __future__ import annotations

import _signal  # noqa: PLC2701 - the C functions under signal.signal and signal.getsignal (see above)
import signal
import threading
import time
import traceback

from conformance.errors import ImplementationError


class _Timeout(BaseException):
    pass


# Signals that arrived while a guarded call ran (counted by _Recording).
_ARRIVED = [0]
_STOPPING = (signal.SIGINT, signal.SIGTERM)


class _Recording:
    """A signal handler that counts the signal, then does what the handler it replaced did."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        _ARRIVED[0] += 1
        if callable(self.previous):
            return self.previous(signum, frame)
        return None


def guarded(what: str, fn, *args, timeout: float | None = None):
    main = threading.current_thread() is threading.main_thread()
    use_alarm = bool(timeout) and hasattr(signal, "setitimer") and main
    outer = None  # (deadline, interval) of a timer that was running before this call
    fire_outer = [False]  # the outer timer is due before this call's timeout
    handed = [False]  # ... and it came due: its handler has the alarm now
    if use_alarm and timeout:
        old = _signal.getsignal(signal.SIGALRM)
        delay, interval = signal.setitimer(signal.ITIMER_REAL, 0)
        if delay > 0:
            outer = (time.monotonic() + delay, interval)

        def on_alarm(signum, frame):
            if fire_outer[0]:  # the outer timer is due first: it fires, with its own handler
                handed[0] = True
                _signal.signal(signal.SIGALRM, old)
                signal.setitimer(signal.ITIMER_REAL, 1e-6, outer[1] if outer else 0)
                return
            raise _Timeout()

        _signal.signal(signal.SIGALRM, on_alarm)
        if outer is not None and delay < timeout:
            fire_outer[0] = True
            signal.setitimer(signal.ITIMER_REAL, delay)
        else:
            signal.setitimer(signal.ITIMER_REAL, timeout)
    handlers = _record_signals() if main else {}
    arrived = _ARRIVED[0]
    try:
        return fn(*args)
    except _Timeout:
        raise ImplementationError("timeout", f"{what} did not return within {timeout:g} s") from None
    except ImplementationError:
        raise
    except (SystemExit, KeyboardInterrupt) as exc:
        if _ARRIVED[0] != arrived:  # a real signal arrived during the call: the run stops
            raise
        tb = traceback.format_exception(exc)
        raise ImplementationError("raised", f"{what} raised {type(exc).__name__}({_args(exc)}) (the implementation "
                                            f"tried to end the process, no signal arrived)\n"
                                  + "".join(tb[-3:])) from exc
    except Exception as exc:  # noqa: BLE001 - any exception of the implementation is a finding
        tb = traceback.format_exception(exc)
        raise ImplementationError("raised", f"{what} raised {type(exc).__name__}: {exc}\n" + "".join(tb[-3:])) from exc
    finally:
        for signum, previous in handlers.items():
            _signal.signal(signum, previous)
        if use_alarm and not handed[0]:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if _signal.getsignal(signal.SIGALRM) is not old:
                _signal.signal(signal.SIGALRM, old)
            if outer is not None:  # the outer timer goes on, for what is left of it
                signal.setitimer(signal.ITIMER_REAL, max(outer[0] - time.monotonic(), 1e-6), outer[1])


def _args(exc: BaseException) -> str:
    return ", ".join(repr(a) for a in exc.args)


def _record_signals() -> dict:
    """Install counting handlers for SIGINT and SIGTERM (where Python handles
    them); return the handlers they replace."""
    replaced = {}
    for signum in _STOPPING:
        try:
            previous = _signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if callable(previous) and not isinstance(previous, _Recording):
            _signal.signal(signum, _Recording(previous))
            replaced[signum] = previous
    return replaced
