"""The Python tool's sandbox (docs/architecture.md §8): a warm pool of confined interpreters.

`make_sandbox(config)` returns a `Sandbox`; `run(code, stdin)` gives an `ExecResult` (outcome.py):
the status, the error class, the captured streams and the wall time. Wording that for the model is
the caller's business (the collect loop uses `tools.responses.format_tool_response`). `run_many` spreads
snippets over the pool and keeps their order. The pool is thread-safe: the agent loop may call
`run` from threads.

Local backend (default). `workers` warm worker processes (worker.py) each fork one fresh child per
execution (child.py; forked and confined ahead of time, waiting for its code), so a snippet pays
neither an interpreter start nor a fork, and no state leaks between executions. What is enforced
on Linux:
- when running as root: the child runs as an unprivileged uid, one per worker and unique on the
  host (61000 + k, claimed with a lock file), with no supplementary groups and PR_SET_NO_NEW_PRIVS,
  so it cannot read root-only files, signal the worker or anything else, or regain root through a
  setuid binary; RLIMIT_NPROC (max_processes) binds per worker uid, so a fork bomb stops at that
  many processes; on timeout and after every execution every process of that uid is SIGKILLed, so
  daemons, forks and threads never outlive their execution;
- when running as root: a private network namespace per worker (only a downed loopback: every
  connect fails) and a private mount namespace in which /tmp is a size-limited tmpfs
  (4 x max_file_size_mb, at least 64 MB, mode 0711) holding the per-execution workdirs (mode 0700,
  owned by the sandbox uid, removed afterwards) and /var/tmp, /run/lock, /dev/shm are not writable.
  With no writable directory left outside its workdir, the code cannot write anywhere else (the
  rest of the host filesystem is as writable as it is to an ordinary user: root-owned directories
  are not). An interpreter installed under a directory others cannot enter (pyenv's /root) is
  bound back read-only over an empty tmpfs there, so the rest of /root stays hidden;
- always: wall clock (timeout_s, from the moment the code is sent), RLIMIT_CPU, RLIMIT_AS
  (memory_mb, which includes the warm interpreter's own address space, larger with
  preload_scientific), RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps, stdin from /dev/null unless
  given, stdout/stderr truncated with a `...[truncated N chars]` marker.
Needs Linux (fork, namespaces, prctl; pidfd_open from 5.3, else the child is polled). Not
enforced: without root there is no uid drop, no network or mount namespace and no NPROC bound
(the kill is of the child's process group; a process that calls setsid escapes it); /proc still
shows the host's processes (read-only, as to any user); there is no seccomp filter and no cgroup,
so memory is bounded per process (RLIMIT_AS), not per execution.

Failures of the sandbox itself (a worker that dies, a broken pipe, a child that fails before user
code starts) are retried transparently on a fresh worker up to `infra_retries` times and only then
reported with status `infra_error`; they are never the model's fault.

Docker backend (`backend="docker"`, docker_backend.py): one container per execution; unverified
where no Docker engine runs.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from cleaner.sandbox.base import Sandbox, SandboxError
from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.outcome import ExecResult, ExecStatus, infra_error_result
from cleaner.sandbox.protocol import PeerLost, receive_message_before, send_message

logger = logging.getLogger(__name__)

WORKER_MODULE = "cleaner.sandbox.worker"
WORKER_START_TIMEOUT_S = 60.0  # a worker imports numpy and sympy before it says hello
REPLY_GRACE_S = 10.0  # a worker silent this long after the deadline is considered lost


@dataclass(frozen=True)
class WorkerInfo:
    pid: int  # worker process id
    uid: int | None  # the unprivileged uid its executions run as; None without root
    network_isolated: bool  # private network namespace in effect
    filesystem_isolated: bool  # private /tmp (and unwritable /var/tmp, /dev/shm) in effect


def make_sandbox(config: SandboxConfig) -> Sandbox:
    """The local warm pool, or the docker backend when config.backend == "docker"."""
    if config.backend == "docker":
        # Imported here: the docker backend (and through it the optional docker SDK) loads only
        # when asked for.
        from cleaner.sandbox.docker_backend import DockerSandbox  # (optional extra: docker)

        return DockerSandbox(config)
    return LocalSandbox(config)


# ---------------------------------------------------------------------------------------------
# Local backend: one warm worker per slot


def worker_command(config: SandboxConfig, preferred_uid: int | None) -> list[str]:
    """The worker's command line: the installed package's module, from any working directory
    (`-P`: that directory is not put on the worker's sys.path; see worker.py)."""
    uid = "-" if preferred_uid is None else str(preferred_uid)
    return [sys.executable, "-P", "-m", WORKER_MODULE, config.to_json(), uid]


class _WorkerProcess:
    """One warm worker process, seen from the pool; restarted lazily after it is lost."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self.info: WorkerInfo | None = None

    def start(self) -> None:
        preferred_uid = None if self.info is None else self.info.uid  # keep the uid across restarts
        self.process = subprocess.Popen(worker_command(self.config, preferred_uid), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)

    def await_hello(self) -> None:
        try:
            hello = receive_message_before(self.process.stdout.fileno(),
                                           time.monotonic() + WORKER_START_TIMEOUT_S)
        except PeerLost as lost:
            self.kill()
            raise SandboxError(f"sandbox worker did not start: {lost}") from lost
        self.info = WorkerInfo(hello["pid"], hello["uid"], hello["network_isolated"],
                               hello["filesystem_isolated"])

    def execute(self, code: str, stdin: str | None) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.start()
            self.await_hello()
        try:
            send_message(self.process.stdin.fileno(), {"code": code, "stdin": stdin})
        except OSError as error:
            raise PeerLost(f"cannot send to worker: {error}") from error
        deadline = time.monotonic() + self.config.timeout_s + REPLY_GRACE_S
        return receive_message_before(self.process.stdout.fileno(), deadline)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        """Ask the worker to clean up and exit; kill it if it does not within a few seconds."""
        if self.process is None:
            return
        try:
            send_message(self.process.stdin.fileno(), {"op": "exit"})
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        self.kill()


class LocalSandbox(Sandbox):
    """A pool of `config.workers` warm workers; each execution borrows one."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._workers = [_WorkerProcess(config) for _ in range(config.workers)]
        self._idle: queue.Queue[_WorkerProcess] = queue.Queue()
        self._closed = threading.Event()
        for worker in self._workers:  # start all, then wait: start-ups overlap
            worker.start()
        try:
            for worker in self._workers:
                worker.await_hello()
        except SandboxError:
            self.close()
            raise
        for worker in self._workers:
            self._idle.put(worker)

    @property
    def workers(self) -> list[WorkerInfo]:
        """What each worker reported at its (latest) start."""
        return [worker.info for worker in self._workers]

    def run(self, code: str, stdin: str | None = None) -> ExecResult:
        if self._closed.is_set():
            raise SandboxError("the sandbox is closed")
        worker = self._idle.get()
        try:
            return self._run_on(worker, code, stdin)
        finally:
            self._idle.put(worker)

    def _run_on(self, worker: _WorkerProcess, code: str, stdin: str | None) -> ExecResult:
        failure = ""
        for attempt in range(self.config.infra_retries + 1):
            try:
                reply = worker.execute(code, stdin)
            except (PeerLost, SandboxError) as lost:
                failure = str(lost)
                logger.warning("sandbox worker lost (attempt %d): %s", attempt + 1, failure)
                worker.kill()
                continue
            if reply["status"] == ExecStatus.INFRA_ERROR:
                failure = reply["stderr"]
                logger.warning("sandbox execution failed (attempt %d): %s", attempt + 1, failure)
                worker.kill()  # a worker whose children cannot start is poisoned
                continue
            return ExecResult(ExecStatus(reply["status"]), reply["error_type"], reply["stdout"],
                              reply["stderr"], reply["exec_ms"])
        return infra_error_result(f"sandbox failed {self.config.infra_retries + 1} times: {failure}")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.shutdown_executor()
        for worker in self._workers:
            worker.stop()
