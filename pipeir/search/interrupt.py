"""Stopping a search at once on Ctrl-C (SIGINT), CP-SAT included.

CP-SAT solves in C++ threads. By default it catches SIGINT itself and ends only the solve
in progress, as if its time limit were up, so `pipeirc synth` went on to its next phase and
a user's Ctrl-C seemed ignored; and with that turned off (`catch_sigint_signal`), Python's
handler would wait for the solve to return, up to its whole time limit. So every solve runs
inside `solving`, which registers the solver, and `interruptible` (installed by the CLI)
watches the interpreter's wakeup file descriptor from a thread: on SIGINT it stops every
registered solver (`StopSearch`, which is thread-safe), and the main thread raises
`KeyboardInterrupt` as soon as the solve returns. CP-SAT can take seconds to notice the stop
(2.7 s was measured in presolve on a loaded machine), so after `GRACE` seconds the watcher
prints the interrupted line itself and ends the process: within `interruptible` nothing is
being written (the CLI writes only a finished search's schedule, after it), so there is no
partial file to leave.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from pipeir.diagnostics import INTERRUPTED
from pipeir.usercode import EXIT_INTERRUPT

#: Seconds the main thread gets to unwind after Ctrl-C before the process is ended.
GRACE = 1.0


class Stoppable(Protocol):
    """What a solver offers to be stopped from another thread (CP-SAT's `CpSolver`)."""

    def stop_search(self) -> None: ...


_lock = threading.Lock()
_active: set[Stoppable] = set()
_stopped = threading.Event()
_done = threading.Event()  # `interruptible` has ended: the watcher must not end the process


def stop() -> None:
    """Stop every solver now running, and any that starts before `interruptible` ends."""
    with _lock:
        _stopped.set()
        for solver in _active:
            solver.stop_search()


@contextmanager
def solving(solver: Stoppable) -> Iterator[None]:
    """Run a solve of `solver` that `stop` can end (a stop already asked for ends it at
    once: the solver is stopped before it starts)."""
    with _lock:
        _active.add(solver)
        if _stopped.is_set():
            solver.stop_search()
    try:
        yield
    finally:
        with _lock:
            _active.discard(solver)


@contextmanager
def interruptible(before_exit: Callable[[], None] | None = None) -> Iterator[None]:
    """Within it, SIGINT stops the solvers at once (`stop`) and raises `KeyboardInterrupt`
    in the main thread as Python does; if that takes over `GRACE` seconds, `before_exit`
    (e.g. ending a progress line) runs and the process ends with the interrupted line.
    Outside the main thread it does nothing (only there can the wakeup descriptor be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _done.clear()
    watcher = threading.Thread(target=_watch, args=(read, before_exit), name="pipeir-sigint",
                               daemon=True)
    watcher.start()
    try:
        yield
    finally:
        _done.set()
        signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
        os.close(write)  # the watcher reads end of file and returns
        watcher.join()
        os.close(read)
        _stopped.clear()


def _watch(fd: int, before_exit: Callable[[], None] | None) -> None:
    """Read the signal numbers the interpreter writes to `fd` until end of file."""
    while data := os.read(fd, 64):
        if signal.SIGINT in data:
            stop()
            if not _done.wait(GRACE):  # the solver has not returned yet
                if before_exit is not None:
                    before_exit()
                sys.stderr.flush()
                os.write(2, f"{INTERRUPTED}\n".encode())
                os._exit(EXIT_INTERRUPT)
