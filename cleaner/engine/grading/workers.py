"""Reward worker processes: rewards computed off the collection's process, each call under a timeout
that kills it (grading/runner.py; docs/architecture.md §5).

Design decisions:
- Workers are processes of our own, `python -m cleaner.engine.grading.workers`, talking over their
  stdin and stdout (a 4-byte length, then a pickle: both ends are this module). Not
  multiprocessing: its spawned workers import the caller's main script again, so a user's script
  that calls cleaner at its top level, without a `__main__` guard, would run again in each worker.
- A worker's main thread runs the call, so signal-based timeouts work there (math-verify's, which
  a verl reward function calls too). It ignores SIGINT and sits in a session of its own: a Ctrl-C is
  the collection's to handle. It ends when its stdin closes, and, busy or not, once its parent is
  gone, so it never outlives the collection's process, whatever kills that.
- A call's clock starts when the worker is handed it: waiting for a free worker, and a worker's
  start-up (its imports), are not the call's. Past its timeout the worker is killed and a new one
  starts for the next call; a worker that dies under a call is reported as that call's error.
- What is called is named, not pickled: `module:qualname` of an importable function, or a reward
  function's `PATH.py:NAME` spec, loaded in the worker by plugins.py (once per file content, so a
  file fixed since is read again).
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from cleaner.engine.grading.reward_file import RewardFunction
from cleaner.tools.calls import Timed

WORKERS = min(8, os.cpu_count() or 1)  # reward worker processes at most
START_TIMEOUT_S = 120.0  # a worker imports what rewards need (sympy, math-verify) before it is ready
HEADER = struct.Struct("<I")


class WorkerLost(RuntimeError):
    """A reward worker process died, or did not start."""


# ---------------------------------------------------------------------------------------------
# Framing


def _send(fd: int, message: object) -> None:
    payload = pickle.dumps(message)
    data = HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def _receive(fd: int, deadline: float | None = None) -> object:
    """The next message; WorkerLost at end of stream, TimeoutError past `deadline`."""
    def read(size: int) -> bytes:
        buffer = bytearray()
        while len(buffer) < size:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(fd, size - len(buffer))
            if not chunk:
                raise WorkerLost("end of stream")
            buffer += chunk
        return bytes(buffer)

    return pickle.loads(read(HEADER.unpack(read(HEADER.size))[0]))


# ---------------------------------------------------------------------------------------------
# The caller's side


def function_ref(function: Callable) -> tuple[str, str]:
    """How a worker finds an importable function: ("callable", "module:qualname")."""
    return "callable", f"{function.__module__}:{function.__qualname__}"


def spec_ref(spec: str) -> tuple[str, str]:
    """How a worker finds a reward function from the user's file: ("spec", "PATH.py:NAME"); it is
    called with the keywords of its one argument, a dict."""
    return "spec", spec


class _Worker:
    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def _start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        try:
            _receive(self.process.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)  # ready
        except (TimeoutError, WorkerLost) as error:
            self.kill()
            raise WorkerLost(f"a reward worker did not start ({type(error).__name__})") from error

    def call(self, ref: tuple[str, str], args: tuple, timeout_s: float) -> Timed:
        if self.process is None or self.process.poll() is not None:
            self._start()
        started = time.monotonic()
        try:
            _send(self.process.stdin.fileno(), (ref, args))
            ok, value = _receive(self.process.stdout.fileno(), started + timeout_s)
        except TimeoutError:
            self.kill()  # the call ran past its timeout: its worker goes with it
            return Timed(seconds=time.monotonic() - started, timed_out=True)
        except (WorkerLost, OSError):
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            return Timed(error=WorkerLost(f"its worker process died (exit code {code})"),
                         seconds=time.monotonic() - started)
        seconds = time.monotonic() - started
        return Timed(value, None, seconds) if ok else Timed(error=value, seconds=seconds)

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                stream.close()
        self.process = None


class RewardWorkers:
    """Up to `size` reward workers, started as calls need them; thread-safe, blocking calls."""

    def __init__(self, size: int = WORKERS) -> None:
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(_Worker())
        self._all = list(self._idle.queue)

    def call(self, ref: tuple[str, str], args: tuple, timeout_s: float) -> Timed:
        """Run what `ref` names on `args` in a worker, once one is free (no clock runs meanwhile)."""
        worker = self._idle.get()
        try:
            return worker.call(ref, args, timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self._all:
            worker.kill()


_workers: RewardWorkers | None = None
_workers_lock = threading.Lock()


def reward_workers() -> RewardWorkers:
    """This process's reward workers (shared by its collections; they end with it)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = RewardWorkers()
            atexit.register(_workers.close)  # a worker busy with a hung call does not read its stdin
        return _workers


# ---------------------------------------------------------------------------------------------
# The worker's side


def _resolve(ref: tuple[str, str]) -> Callable:
    kind, name = ref
    if kind == "spec":
        return RewardFunction.load(name).function
    module, _, qualname = name.partition(":")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _watch_parent(parent: int) -> None:
    """End this worker once its parent is gone (a SIGKILLed collection runs no exit handler), even
    while a call hangs on the main thread."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # what the user's function prints goes to stderr, never into the replies
    import cleaner.engine.grading.answers  # noqa: F401 - math-verify and sympy before the first call is timed

    _send(stdout, "ready")
    while True:
        try:
            ref, args = _receive(stdin)
        except WorkerLost:
            return  # the collection's process is gone
        try:
            function = _resolve(ref)
            reply = (True, function(**args[0]) if ref[0] == "spec" else function(*args))
        except Exception as error:  # noqa: BLE001 - the caller's to word
            reply = (False, error)
        try:
            _send(stdout, reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # a value or an error pickle cannot carry
            _send(stdout, (False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]!r:.300}")))


if __name__ == "__main__":
    _serve()
