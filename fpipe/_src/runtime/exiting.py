"""How a process ends after a pipeline failed in it.

# NOTE [threads at exit]
fpipe runs daemon threads per process group: the send reaper, blocked in gloo's send waits, and
the wait watch, which writes to the c10d store. Python 3.11 ends a daemon thread that returns
from a C++ call during interpreter teardown by unwinding it from inside that call, which torch's
bindings cannot survive: the process aborts ("terminate called without an active exception").
A gloo send wait ends when its peer process exits, so after a failure -- a send whose receiver
stopped -- two peers exiting at the same moment would abort each other at random. Hence
`_settle`, an atexit handler (it runs while Python is whole, after the user's own handlers): the
watches stop, and each reaper gets time to finish what it is doing -- a wait that ends because a
peer exited, and the store reads that follow -- before teardown begins. A reaper still blocked
on a peer that stays alive is left behind after 3 s + 0.5 s x its pipeline rank, so ranks that
block each other leave one after another, each one's exit ending the next one's wait while that
one is still in this handler. In a run without failure no send is pending at exit: this costs
nothing.

A failure that escapes to the top level needs none of this: `exit_hard_after_failure` ends the
process right after the traceback and the atexit handlers, skipping teardown.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

EXITING = threading.Event()  # set at exit: background threads stop touching torch
_settlers: list[Callable[[], None]] = []
_hard = threading.Event()
_hook_installed = False


def settle_at_exit(settle: Callable[[], None]) -> None:
    """Call `settle` at exit, before teardown (see the NOTE)."""
    _settlers.append(settle)


def _settle() -> None:
    EXITING.set()
    if _hard.is_set():  # os._exit follows: no teardown to protect
        return
    for settle in list(_settlers):
        settle()


atexit.register(_settle)


def exit_hard_after_failure() -> None:
    """Once a pipeline failed in this process: should an exception then escape to the top level
    (the failure, uncaught), end the process with status 1 right after Python printed it and
    ran the atexit handlers, skipping only the interpreter's teardown, where a transport thread
    still blocked on a vanished peer could hang or abort it. A script that catches the failure
    and goes on is left alone: it exits when and how it chooses, its atexit handlers run."""
    global _hook_installed
    if not _hook_installed:
        _hook_installed = True
        sys.excepthook = functools.partial(_exit_after_uncaught, sys.excepthook)


def _exit_after_uncaught(previous: Callable[..., Any], kind: Any, value: Any, tb: Any) -> None:
    previous(kind, value, tb)  # the traceback, printed as usual
    _hard.set()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
