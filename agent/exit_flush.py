"""Agents that were never closed still deliver: at interpreter exit and on SIGTERM.

``register`` keeps a weak reference to an object with ``closed``, ``flush(timeout)`` and ``close(timeout)`` (an
agent's shipper, a transport). At exit every live one that is not closed is closed. On SIGTERM they are closed and
the process ends as SIGTERM's default would; when the program had a SIGTERM handler of its own, they are only
flushed (the program may go on) and that handler runs. Both within
``EXIT_TIMEOUT`` seconds in all; whatever could not be sent stays in the spool for the next process or
`fp8mon sync`. The SIGTERM handler is installed from the main thread only (Python allows no other), over a default
or Python handler, never over an ignored signal.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref

__all__ = ["register"]

log = logging.getLogger("fp8mon.agent")

EXIT_TIMEOUT = 10.0

_live: list[weakref.ref] = []
_lock = threading.Lock()
_installed = False
_previous_sigterm = None


def register(obj) -> None:
    global _installed
    with _lock:
        _live[:] = [ref for ref in _live if ref() is not None]
        _live.append(weakref.ref(obj))
        if _installed:
            return
        _installed = True
    atexit.register(_at_exit)
    _install_sigterm()


def _open_ones() -> list:
    """Newest first: an agent's shipper before the transport it closes itself."""
    with _lock:
        objs = [ref() for ref in reversed(_live)]
    return [obj for obj in objs if obj is not None and not obj.closed]


def _each(action: str) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT
    for obj in _open_ones():
        left = deadline - time.monotonic()
        if left <= 0:
            log.error("fp8mon: no time left to %s the agent at exit; what it holds stays in its spool", action)
            return
        try:
            getattr(obj, action)(left)
        except Exception:
            log.exception("fp8mon: could not %s the agent at exit", action)


def _at_exit() -> None:
    _each("close")


def _off_main_thread(action: str) -> None:
    """The signal interrupted the main thread anywhere, possibly holding a lock of the agent's queues: the work
    runs on a thread of its own, waited for a bounded time, so it can never deadlock on such a lock."""
    worker = threading.Thread(target=_each, args=(action,), name="fp8mon-sigterm", daemon=True)
    worker.start()
    worker.join(EXIT_TIMEOUT + 1.0)


def _install_sigterm() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: leave it alone
        return
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    previous = _previous_sigterm
    # the program handles SIGTERM itself and may go on: deliver, but stay open
    _off_main_thread("flush" if callable(previous) else "close")
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # end as the default handler would: killed by SIGTERM
    os.kill(os.getpid(), signum)
