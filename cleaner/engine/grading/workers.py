"""Reward worker processes: rewards computed off the collection's process, each call under a timeout
that kills it (grading/runner.py; docs/architecture.md §5).

Design decisions:
- Workers are processes of our own, `python -m cleaner.engine.grading.workers`, talking over two
  pipes of their own (a pickle in sandbox/protocol.py's frames: both ends are this module), never their
  stdin and stdout: a reward's subprocess (a code judge, a shell) inherits those, and what it
  writes there must not land in a reply. A worker's stdout and stderr are the collection's stderr,
  where what a reward and its subprocesses print can be read (docs/byo-task.md); its stdin is
  /dev/null. Not multiprocessing: its spawned workers import the caller's main script again, so a
  user's script that calls cleaner at its top level, without a `__main__` guard, would run again
  in each worker.
- A worker's main thread runs the call, so signal-based timeouts work there (math-verify's, which
  a verl reward function calls too). It ignores SIGINT and sits in a session of its own: a Ctrl-C is
  the collection's to handle. It ends when its stdin closes, and, busy or not, once its parent is
  gone, so it never outlives the collection's process, whatever kills that.
- A call's clock starts when the worker is handed it: waiting for a free worker, and a worker's
  start-up (its imports), are not the call's. Past its timeout the worker is killed with its whole
  process group (it leads a session of its own, so every process a reward started goes with it,
  none left orphaned), and a new one starts for the next call; a worker that dies under a call is
  reported as that call's error. One found dead between calls goes the same way (its group killed,
  its pipes closed) before a new one starts.
- Replies are awaited with `poll` (protocol.py's `receive_frame`), not `select`, which refuses a
  descriptor >= 1024 (FD_SETSIZE): a collection holding many sockets and files open gets such
  descriptors for its pipes.
- What is called is named, not pickled: `module:qualname` of an importable function, or a reward
  function's `PATH.py:NAME` spec, loaded in the worker by plugins.py (once per file content, so a
  file fixed since is read again).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from cleaner.engine.grading.reward_file import RewardFunction
from cleaner.sandbox.protocol import receive_frame, send_frame
from cleaner.tools.calls import Timed

WORKERS = min(8, os.cpu_count() or 1)  # reward worker processes at most
START_TIMEOUT_S = 120.0  # a worker imports what rewards need (sympy, math-verify) before it is ready


class WorkerLost(RuntimeError):
    """A reward worker process died, or did not start."""


# ---------------------------------------------------------------------------------------------
# Framing


def _send(fd: int, message: object) -> None:
    send_frame(fd, pickle.dumps(message))


def _receive(fd: int, deadline: float | None = None) -> object:
    """The next message; WorkerLost at end of stream, TimeoutError past `deadline`."""
    try:
        return pickle.loads(receive_frame(fd, deadline))
    except EOFError:
        raise WorkerLost("end of stream") from None


# ---------------------------------------------------------------------------------------------
# The caller's side


def function_ref(function: Callable) -> tuple[str, str]:
    """How a worker finds an importable function: ("callable", "module:qualname")."""
    return "callable", f"{function.__module__}:{function.__qualname__}"


def spec_ref(spec: str) -> tuple[str, str]:
    """How a worker finds a reward function from the user's file: ("spec", "PATH.py:NAME"); it is
    called with the keywords of its one argument, a dict."""
    return "spec", spec


def _stderr() -> int:
    """Where a worker's stdout goes: this process's stderr (fd 2), or /dev/null where it has none."""
    try:
        os.fstat(2)
    except OSError:
        return subprocess.DEVNULL
    return 2


class _Worker:
    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.requests = self.replies = -1  # this side's ends of the worker's two pipes

    def _start(self) -> None:
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(requests_read), str(replies_write)], stdin=subprocess.DEVNULL,
                stdout=_stderr(), pass_fds=(requests_read, replies_write), start_new_session=True)
        finally:
            os.close(requests_read)
            os.close(replies_write)
        try:
            _receive(self.replies, time.monotonic() + START_TIMEOUT_S)  # ready
        except (TimeoutError, WorkerLost) as error:
            self.kill()
            raise WorkerLost(f"a reward worker did not start ({type(error).__name__})") from error

    def call(self, ref: tuple[str, str], args: tuple, timeout_s: float) -> Timed:
        if self.process is None or self.process.poll() is not None:
            self.kill()  # one that died idle: its pipes closed, what its rewards left running killed
            self._start()
        started = time.monotonic()
        try:
            _send(self.requests, (ref, args))
            ok, value = _receive(self.replies, started + timeout_s)
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
        """The worker and every process of its group (what its rewards started), then its pipes."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # a group already gone
                os.killpg(self.process.pid, signal.SIGKILL)  # its pid is its group's id: it leads its session
            self.process.wait()
        for fd in (self.requests, self.replies):
            if fd >= 0:
                os.close(fd)
        self.process, self.requests, self.replies = None, -1, -1


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
    while a call hangs on the main thread, and with it every process its rewards started: the
    worker leads its process group, which is killed whole, as at a timeout."""
    while os.getppid() == parent:
        time.sleep(1.0)
    with contextlib.suppress(OSError):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os._exit(1)  # reached only where the group could not be signalled


def _serve(requests: int, replies: int) -> None:
    """Answer calls from `requests` on `replies` (module notes: neither is a standard stream)."""
    for fd in (requests, replies):
        os.set_inheritable(fd, False)  # a reward's `os.system` or shell never holds them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    import cleaner.engine.grading.answers  # noqa: F401 - math-verify and sympy before the first call is timed

    _send(replies, "ready")
    while True:
        try:
            ref, args = _receive(requests)
        except WorkerLost:
            return  # the collection's process is gone
        try:
            function = _resolve(ref)
            reply = (True, function(**args[0]) if ref[0] == "spec" else function(*args))
        except Exception as error:  # noqa: BLE001 - the caller's to word
            reply = (False, error)
        try:
            _send(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # a value or an error pickle cannot carry
            _send(replies, (False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]!r:.300}")))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
