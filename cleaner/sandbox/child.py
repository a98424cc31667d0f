"""One execution inside a warm worker: fork a fresh child, confine it, supervise it, clean up.

The worker owns an `Executor` and hands it its `Reaper` (isolation.py), the one object that knows
the sandbox uid and whether this process reaps orphans; nothing here reads another module's state.

Design decisions:
- A spare child: right after each execution's clean-up, the worker forks and confines the NEXT
  child, which waits on a request pipe; an execution only sends it the code. Fork and confinement
  (the bulk of the cost with numpy and sympy warm) are thus off the critical path. The wall clock
  starts when the request is sent.
- The child is confined in this order (each step needs the privileges the next one drops): own
  session; fds set (stdin = /dev/null, replaced by a memfd holding the given stdin once the request
  arrives; stdout and stderr are pipes; the result and request pipes sit at the highest fds
  RLIMIT_NOFILE allows; the request pipe is closed before user code runs), every other fd closed
  (the worker's protocol pipes, the uid lock); SIGXFSZ ignored so an oversized write fails with
  EFBIG instead of killing the process; resource limits; chdir into the private workdir; then
  setgroups([]) / setgid / setuid to the worker's sandbox uid, PR_SET_NO_NEW_PRIVS (no setuid binary
  can give root back) and a parent-death signal.
- The worker reads stdout/stderr while the child runs, keeping only the first `4 * max_output_chars`
  bytes and counting the rest, so printing 100 MB costs pipe bandwidth, not memory, and never blocks
  the child on a full pipe.
- The child writes `S` on the result pipe just before user code starts and a JSON result after it
  ends; it then closes its pipes, so the worker answers without waiting for the exit's teardown. No
  `S` means the sandbox itself failed (an infrastructure error, retried by the pool); `S` without a
  result means the user code ended the process itself (os._exit, a signal).
- Wall clock: the deadline runs from the request. On timeout, and after every execution, every
  process of the sandbox uid is killed (`Reaper.kill_execution`); without root, the child's process
  group is killed.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from cleaner.sandbox import usercode
from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.isolation import LIBC, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, Reaper
from cleaner.sandbox.outcome import ExecStatus
from cleaner.sandbox.protocol import receive_message, send_message

RESULT_LOST_EXIT = 1  # exit code of a child whose code failed but whose result pipe the code closed
SETUP_FAILED_EXIT = 121  # exit code of a child whose confinement failed before user code ran
DRAIN_GRACE_S = 1.0  # after the kill, how long to wait for the output pipes to close
CHUNK_BYTES = 1 << 16
POLL_S = 0.002  # child-exit polling period where pidfd_open is missing
REPORTED = 0  # the "wait status" of a child that reported its result and closed its pipes
SINGLE_THREAD_ENV = {name: "1" for name in (  # BLAS pools of one thread: the worker stays fork-safe
    "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")}
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             **SINGLE_THREAD_ENV}


# ---------------------------------------------------------------------------------------------
# Child side (runs after fork; never returns)


def _place_fds(pipes: tuple[int, ...], targets: tuple[int, ...]) -> None:
    """Put each pipe end at its target fd; close every other fd."""
    high = [os.dup(fd) for fd in pipes]  # dodge clashes between sources and targets
    for target, fd in zip(targets, high, strict=True):
        os.dup2(fd, target)
    keep = sorted(targets)
    for low, next_kept in zip(keep, keep[1:] + [resource.getrlimit(resource.RLIMIT_NOFILE)[0]], strict=True):
        os.closerange(low + 1, next_kept)


def _set_limits(config: SandboxConfig) -> None:
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (config.cpu_time_s, config.cpu_time_s + 1),
        resource.RLIMIT_NPROC: (config.max_processes, config.max_processes),
        resource.RLIMIT_FSIZE: (config.max_file_size_mb * mb, config.max_file_size_mb * mb),
        resource.RLIMIT_NOFILE: (config.max_open_files, config.max_open_files),
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_AS: (config.memory_mb * mb, config.memory_mb * mb),
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)


def _confine(config: SandboxConfig, uid: int | None, workdir: str) -> None:
    os.setsid()
    for signal_number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signal_number, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(CHILD_ENV, HOME=workdir, TMPDIR=workdir)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise RuntimeError("privilege drop did not take effect")
    LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    _set_limits(config)


def _child_main(config: SandboxConfig, uid: int | None, workdir: str, pipes: tuple[int, ...]) -> None:
    """Confine this process, wait for the request, run it. Never returns."""
    result_fd = config.max_open_files - 1  # the highest fds allowed: out of the way of user files
    request_fd = result_fd - 1
    _place_fds(pipes, (0, 1, 2, result_fd, request_fd))
    _confine(config, uid, workdir)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.path.insert(0, workdir)
    sys.argv = [""]
    if "numpy.random" in sys.modules:  # `random` reseeds itself after fork; numpy does not
        sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))
    request = receive_message(request_fd)  # a spare child waits here
    if request is None:  # discarded unused
        os._exit(0)
    os.close(request_fd)
    if request["stdin"] is not None:  # a memfd, so reads never block (size bound: RLIMIT_FSIZE)
        stdin_fd = os.memfd_create("stdin")
        os.write(stdin_fd, request["stdin"].encode("utf-8"))
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
    os.write(result_fd, b"S")
    error_type, error_text = usercode.execute_user_code(request["code"])
    usercode.flush_standard_streams()
    for fd in (0, 1, 2):  # EOF now lets the worker answer without waiting for this exit's teardown
        _close_quietly(fd)
    try:
        os.write(result_fd, json.dumps({"error_type": error_type, "error_text": error_text}).encode())
    except OSError:  # the code closed the result pipe: the exit status is all that is left
        os._exit(0 if error_type is None else RESULT_LOST_EXIT)
    _close_quietly(result_fd)
    os._exit(0)  # daemon threads die here, mid-loop, as they should


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# Worker side


class OutputCapture:
    """The head of one stream plus a count of the bytes dropped after it (the docker backend
    captures its containers' output with it too)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes, self.head, self.dropped_bytes = keep_bytes, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = max(0, self.keep_bytes - len(self.head))
        self.head += chunk[:room]
        self.dropped_bytes += len(chunk) - min(room, len(chunk))


def truncate_text(capture: OutputCapture, max_chars: int) -> str:
    """Decoded head, cut to max_chars with a `...[truncated N chars]` marker (N counts dropped bytes
    beyond the kept head as one char each)."""
    text = capture.head.decode("utf-8", errors="replace")
    extra = len(text) - max_chars if len(text) > max_chars else 0
    dropped = extra + capture.dropped_bytes
    if dropped == 0:
        return text
    return f"{text[:max_chars]}...[truncated {dropped} chars]"


def _pump(streams: dict[int, OutputCapture], timeout_s: float, extra_fds: tuple[int, ...] = ()) -> list[int]:
    """Wait up to timeout_s; read every ready stream (closing it at EOF); return ready extra fds."""
    ready, _, _ = select.select([*streams, *extra_fds], [], [], max(0.0, timeout_s))
    for fd in ready:
        if fd in streams:
            chunk = os.read(fd, CHUNK_BYTES)
            if chunk:
                streams[fd].add(chunk)
            else:
                os.close(fd)
                streams.pop(fd)
    return [fd for fd in ready if fd in extra_fds]


def _supervise(pid: int, streams: dict[int, OutputCapture], result_fd: int, deadline: float) -> int | None:
    """Pump output until the child is done or the deadline passes (None). Done is: the child
    exited (its wait status), or it closed the result pipe after its closing JSON (0; its exit is
    collected later, so the teardown of a large address space is not on the critical path)."""
    result = streams[result_fd]
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3: poll the child every POLL_S instead
        pidfd = None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if pidfd is not None:
                if _pump(streams, remaining, (pidfd,)):
                    return os.waitpid(pid, 0)[1]
            else:
                _pump(streams, min(remaining, POLL_S))
                exited_pid, wait_status = os.waitpid(pid, os.WNOHANG)
                if exited_pid:
                    return wait_status
            if result_fd not in streams and _parse_outcome(bytes(result.head)) is not None:
                return REPORTED
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _parse_outcome(result: bytes) -> dict | None:
    """The child's closing JSON (the last one: user code may have scribbled on the pipe before it)."""
    start = result.rfind(b'{"error_type"')
    if start < 0:
        return None
    try:
        outcome = json.loads(result[start:])
    except ValueError:
        return None
    return outcome if isinstance(outcome, dict) and {"error_type", "error_text"} <= outcome.keys() else None


def _classify(wait_status: int | None, result: bytes,
              config: SandboxConfig) -> tuple[ExecStatus, str | None, str | None]:
    """(status, error_type, error_text) from the wait status and the result pipe's bytes."""
    if wait_status is None:
        return ExecStatus.TIMEOUT, "Timeout", f"Timeout: execution exceeded the {config.timeout_s:g} s time limit"
    if not result.startswith(b"S"):
        return ExecStatus.INFRA_ERROR, "InfraError", f"sandbox child failed before running code (status {wait_status})"
    outcome = _parse_outcome(result)
    if outcome is not None:
        if outcome["error_type"] is None:
            return ExecStatus.OK, None, None
        return ExecStatus.ERROR, outcome["error_type"], outcome["error_text"]
    if os.WIFSIGNALED(wait_status):
        signal_number = os.WTERMSIG(wait_status)
        if signal_number == signal.SIGXCPU:
            return ExecStatus.TIMEOUT, "Timeout", f"Timeout: CPU time limit of {config.cpu_time_s} s exceeded"
        name = signal.Signals(signal_number).name
        return ExecStatus.ERROR, name, f"{name}: the process was killed by signal {name}"
    exit_code = os.waitstatus_to_exitcode(wait_status)
    if exit_code == 0:
        return ExecStatus.OK, None, None
    return ExecStatus.ERROR, "SystemExit", f"SystemExit: the process exited with code {exit_code}"


@dataclass
class _Child:
    """A forked, confined child waiting for its request, and the worker's ends of its pipes."""

    pid: int
    workdir: str
    request_w: int
    out_r: int
    err_r: int
    result_r: int


def _spawn(config: SandboxConfig, uid: int | None, root: str) -> _Child:
    workdir = os.path.join(root, uuid.uuid4().hex)
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    (out_r, out_w), (err_r, err_w), (result_r, result_w) = os.pipe(), os.pipe(), os.pipe()
    request_r, request_w = os.pipe()
    stdin_fd = os.open(os.devnull, os.O_RDONLY)
    child_ends = (stdin_fd, out_w, err_w, result_w, request_r)
    pid = os.fork()
    if pid == 0:
        try:
            _child_main(config, uid, workdir, child_ends)
        except BaseException as error:  # noqa: BLE001 - reported on stderr, classified infra_error
            os.write(2, f"sandbox child set-up failed: {error!r}".encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    for fd in child_ends:
        os.close(fd)
    return _Child(pid, workdir, request_w, out_r, err_r, result_r)


def _discard(child: _Child, reaper: Reaper) -> None:
    """Kill an unused spare. By pid, as well as by uid: it may still be root, mid-confinement."""
    for fd in (child.request_w, child.out_r, child.err_r, child.result_r):
        _close_quietly(fd)
    try:
        os.kill(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    reaper.kill_execution(child.pid, collect_child=True)
    shutil.rmtree(child.workdir, ignore_errors=True)


class Executor:
    """Runs snippets one at a time, each in a fresh child under `root`, as `reaper.uid` (None: no
    uid drop). With `prefork`, the next child is forked and confined right after each execution's
    clean-up, so the fork is off the critical path."""

    def __init__(self, config: SandboxConfig, reaper: Reaper, root: str, prefork: bool = True) -> None:
        self.config, self.reaper, self.root, self.prefork = config, reaper, root, prefork
        self.uid = reaper.uid
        self._spare = _spawn(config, self.uid, root) if prefork else None

    def _take_child(self, request: dict) -> _Child:
        child, self._spare = self._spare or _spawn(self.config, self.uid, self.root), None
        try:
            send_message(child.request_w, request)
        except BrokenPipeError:  # the spare died while waiting: use a fresh one
            _discard(child, self.reaper)
            child = _spawn(self.config, self.uid, self.root)
            send_message(child.request_w, request)
        os.close(child.request_w)
        return child

    def execute(self, code: str, stdin: str | None) -> tuple[dict, Callable[[], None]]:
        """(the reply for the pool, a clean-up to run after sending it). The clean-up kills every
        leftover process of the execution, removes its workdir, and forks the next spare."""
        start = time.monotonic()
        child = self._take_child({"code": code, "stdin": stdin})
        keep_bytes = 4 * self.config.max_output_chars
        captures = {"stdout": OutputCapture(keep_bytes), "stderr": OutputCapture(keep_bytes),
                    "result": OutputCapture(1 << 20)}
        streams = dict(zip((child.out_r, child.err_r, child.result_r), captures.values(), strict=True))
        wait_status = _supervise(child.pid, streams, child.result_r, start + self.config.timeout_s)
        exec_ms = (time.monotonic() - start) * 1000.0
        for _ in range(64):  # usually every pipe is at EOF once the child is done
            if not streams or not select.select(list(streams), [], [], 0)[0]:
                break
            _pump(streams, 0)
        if streams or wait_status is None:  # something still holds the pipes, or the deadline passed
            self.reaper.kill_execution(child.pid, collect_child=True)
            drain_deadline = time.monotonic() + DRAIN_GRACE_S
            while streams and time.monotonic() < drain_deadline:
                _pump(streams, drain_deadline - time.monotonic())
        for fd in streams:
            os.close(fd)
        return _reply(wait_status, captures, exec_ms, self.config), lambda: self._clean_up(child)

    def _clean_up(self, child: _Child) -> None:
        self.reaper.kill_execution(child.pid, collect_child=True)  # harmless if already collected
        shutil.rmtree(child.workdir, ignore_errors=True)
        if self.prefork:
            self._spare = _spawn(self.config, self.uid, self.root)

    def close(self) -> None:
        if self._spare is not None:
            _discard(self._spare, self.reaper)
            self._spare = None


def execute(code: str, stdin: str | None, config: SandboxConfig, reaper: Reaper,
            root: str) -> tuple[dict, Callable[[], None]]:
    """One execution without a spare child (the fork is on the critical path)."""
    return Executor(config, reaper, root, prefork=False).execute(code, stdin)


def _reply(wait_status: int | None, captures: dict, exec_ms: float, config: SandboxConfig) -> dict:
    status, error_type, error_text = _classify(wait_status, bytes(captures["result"].head), config)
    stderr = truncate_text(captures["stderr"], config.max_output_chars)
    if error_text:
        stderr = f"{stderr.rstrip(chr(10))}\n{error_text}" if stderr.strip() else error_text
    return {"status": status, "error_type": error_type, "exec_ms": exec_ms, "stderr": stderr,
            "stdout": truncate_text(captures["stdout"], config.max_output_chars)}
