"""Ctrl-C: the one stop every command says in one line, and a running DuckDB query interrupted.

Design decisions:
- One wording. A Ctrl-C ends a command with `errors.Stopped` (exit 130, as a shell reports a
  command that SIGINT ended): `error: interrupted: <what is kept>`; a further Ctrl-C while it
  stops says `stopping: <what it is doing>` (`say_stopping`, a warning) instead of interrupting
  the stop. A collection stops the same way (engine/collect/schedule.py), through `deferred`.
- A query runs inside DuckDB's C++ code, and Python runs its SIGINT handler only once that
  returns: a long query ignored every Ctrl-C. While a `QueryStop` is active, the signal's wakeup
  descriptor (`signal.set_wakeup_fd`: the C-level handler writes it at once, whatever the main
  thread is doing) wakes a watcher thread, which calls `interrupt()` on every connection that
  runs a query under `watched` (a cursor is a connection of its own: interrupting its parent
  does not stop it). The query then fails with DuckDB's InterruptException.
- While a query runs under `watched`, the Python-level handler raises nothing: a
  KeyboardInterrupt would land at whatever bytecode follows the interrupted query, inside an
  `except` that words its error or a `finally` that cleans up. It records the press, and the
  block's end turns what then fails into `Stopped`; a loop between queries calls `check()`. With
  no query running it raises KeyboardInterrupt as Python's own handler does, which the block's end
  turns into `Stopped` too.
- Only the main thread installs a handler (Python runs them there alone); on another thread
  `QueryStop` changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Protocol

from cleaner.errors import Stopped

logger = logging.getLogger(__name__)


def say_stopping(doing: str) -> None:
    """What a further Ctrl-C says while a command stops."""
    logger.warning("stopping: %s", doing)


@contextlib.contextmanager
def deferred(doing: str) -> Iterator[None]:
    """While a command stops, a further Ctrl-C says it is stopping instead of interrupting the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: say_stopping(doing))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------
# Queries


class Interruptible(Protocol):
    def interrupt(self) -> None: ...


_running: set[Interruptible] = set()  # connections running a query under `watched`
_running_lock = threading.Lock()


@contextlib.contextmanager
def watched(connection: Interruptible) -> Iterator[Interruptible]:
    """A Ctrl-C under an active `QueryStop` interrupts `connection` while the block runs."""
    with _running_lock:
        _running.add(connection)
    try:
        yield connection
    finally:
        with _running_lock:
            _running.discard(connection)


def _interrupt_running() -> None:
    with _running_lock:
        connections = list(_running)
    for connection in connections:
        with contextlib.suppress(Exception):  # a connection closed meanwhile has nothing to stop
            connection.interrupt()


class QueryStop:
    """For the block, a Ctrl-C interrupts the watched queries (module docstring), and the block
    ends with `Stopped` ("interrupted: <kept>") whatever it was doing: failing, or done."""

    def __init__(self, doing: str, kept: str) -> None:
        self.doing = doing  # what a further Ctrl-C says is happening, e.g. "interrupting the query"
        self.kept = kept  # what the one line says is kept, e.g. "nothing was written"
        self.pressed = False
        self._previous_handler = None
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> QueryStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="cleaner-ctrl-c", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, kind, error, _) -> None:
        self._restore()
        if isinstance(error, KeyboardInterrupt) or (self.pressed and (error is None or isinstance(error, Exception))):
            raise self.stopped() from error

    def _restore(self) -> None:
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGINT, self._previous_handler)
        reader, writer = self._sockets
        writer.close()  # the watcher's recv returns b""
        self._watcher.join()
        reader.close()
        self._sockets = None

    def _on_sigint(self, *_) -> None:
        if self.pressed:
            say_stopping(self.doing)
            return
        self.pressed = True
        with _running_lock:
            querying = bool(_running)
        if not querying:
            raise KeyboardInterrupt

    def _watch(self) -> None:
        reader = self._sockets[0]
        while received := reader.recv(64):  # a byte per signal with a handler; b"" once closed
            if signal.SIGINT in received:
                _interrupt_running()

    def check(self) -> None:
        """`Stopped` if a Ctrl-C came."""
        if self.pressed:
            raise self.stopped()

    def stopped(self) -> Stopped:
        return Stopped(f"interrupted: {self.kept}")
