"""Warm worker of the local sandbox: a long-lived process that forks one fresh child per execution.

Started by the pool as `python -P -m cleaner.sandbox.worker '<SandboxConfig JSON>' <uid or ->`,
from the installed package and whatever the caller's working directory: `-P` keeps that directory
off `sys.path`, so nothing in it can shadow the package or the standard library in the worker, nor
be bound into the sandbox as one of the interpreter's paths. It talks to the pool over its
stdin/stdout with length-prefixed JSON messages (protocol.py) and never prints anything else there.

Design decisions:
- Warm: common modules (`WARM_IMPORTS`; with `preload_scientific` also numpy and sympy) are
  imported once at start-up, so a snippet pays neither an interpreter start nor an `import sympy`.
  The cost: fork and exit scale with the worker's resident memory, so the scientific preload makes
  every execution's CPU cost higher (BENCHMARKS.md, "Sandbox"); the spare child (child.py) keeps
  the fork itself off the latency path. BLAS thread pools are pinned to one thread before any
  import, so the worker stays single-threaded and fork-safe; `gc.freeze()` keeps the warm objects
  out of the children's collections.
- Fresh child per execution: state never leaks between executions; the child runs with its own
  session, a private working directory, resource limits and (when running as root) an unprivileged
  uid.
- Isolation set up once per worker, when running as root (isolation.py): one sandbox uid claimed
  for the worker's lifetime, a private network namespace and a private mount namespace. The worker
  is a child subreaper, so the orphans of its executions are reaped here.
- All of a worker's state (uid, uid lock, isolation, reaper, executor) lives in one `Worker`
  object, passed to what needs it; the module has no mutable globals, so running it as `__main__`
  is the same as importing it.
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile

from cleaner.sandbox.child import SINGLE_THREAD_ENV, Executor
from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.isolation import (
    NO_ISOLATION,
    Reaper,
    become_subreaper,
    claim_uid,
    isolate,
)
from cleaner.sandbox.protocol import receive_message, send_message

WARM_IMPORTS = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
    "bisect", "re", "string", "json", "random", "statistics", "operator", "datetime", "time", "copy",
    "typing", "ast", "base64", "builtins", "io", "signal", "resource", "shutil", "uuid", "select",
)
SCIENTIFIC_WARM_IMPORTS = ("numpy", "numpy.random", "sympy")  # with preload_scientific, if installed


def warm_up(preload_scientific: bool) -> None:
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    for name in SCIENTIFIC_WARM_IMPORTS if preload_scientific else ():
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def take_protocol_fds() -> tuple[int, int]:
    """Move the protocol off fds 0/1 so that nothing else can ever write into it."""
    request_fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 10)
    reply_fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 10)
    null_fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(null_fd, 0)
    os.dup2(2, 1)
    os.close(null_fd)
    return request_fd, reply_fd


class Worker:
    """One warm worker: isolated and warmed up at construction, then `serve()` until told to exit."""

    def __init__(self, config: SandboxConfig, preferred_uid: int | None) -> None:
        self.config = config
        self.request_fd, self.reply_fd = take_protocol_fds()
        become_subreaper()  # orphans of executions come here
        self.uid: int | None = None
        self.uid_lock_fd: int | None = None  # held open for the worker's lifetime: the uid is ours
        self.isolation = NO_ISOLATION
        if os.geteuid() == 0:
            self.uid, self.uid_lock_fd = claim_uid(preferred_uid)
            self.isolation = isolate(config.max_file_size_mb)
        self.reaper = Reaper(self.uid, subreaper=True)
        if self.uid is not None:
            self.reaper.kill_uid()  # leftovers of a previous worker that held this uid
            self.reaper.start_server()  # before the warm imports: a small process to fork
        if self.isolation.filesystem_isolated:
            self.root = "/tmp"  # the private tmpfs
        else:
            self.root = tempfile.mkdtemp(prefix="cleaner-sandbox-")
        warm_up(config.preload_scientific)
        gc.freeze()  # keep the warm objects out of the children's collections: no copy-on-write storm
        self.executor = Executor(config, self.reaper, self.root)

    def hello(self) -> dict:
        """What the pool learns at start-up (pool.WorkerInfo)."""
        return {"pid": os.getpid(), "uid": self.uid,
                "network_isolated": self.isolation.network_isolated,
                "filesystem_isolated": self.isolation.filesystem_isolated}

    def serve(self) -> None:
        """Answer requests until the pool says exit or goes away."""
        send_message(self.reply_fd, self.hello())
        while True:
            request = receive_message(self.request_fd)
            if request is None or request.get("op") == "exit":
                return
            reply, clean_up = self.executor.execute(request["code"], request.get("stdin"))
            try:
                send_message(self.reply_fd, reply)
            except BrokenPipeError:
                return
            finally:
                clean_up()

    def close(self) -> None:
        self.executor.close()
        if self.uid is not None:
            self.reaper.kill_uid()
        if not self.isolation.filesystem_isolated:
            shutil.rmtree(self.root, ignore_errors=True)  # a host directory; the private /tmp vanishes by itself


def main(argv: list[str]) -> int:
    os.environ.update(SINGLE_THREAD_ENV)  # before numpy is imported by the warm-up
    config = SandboxConfig(**json.loads(argv[1]))
    preferred_uid = int(argv[2]) if len(argv) > 2 and argv[2] != "-" else None
    worker = Worker(config, preferred_uid)
    worker.serve()
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
