"""One execution inside a warm worker: fork a fresh child, confine it, supervise it, clean up.

Design decisions:
- The child is confined in this order (each step needs the privileges the next one drops): own
  session; fds set (stdin = /dev/null or a memfd holding the given stdin; stdout and stderr are
  pipes; the result pipe sits at the highest fd RLIMIT_NOFILE allows), every other fd closed (the protocol pipes, the uid lock);
  SIGXFSZ ignored so an oversized write fails with EFBIG instead of killing the process; resource
  limits; chdir into the private workdir; then setgroups([]) / setgid / setuid to the worker's
  sandbox uid, PR_SET_NO_NEW_PRIVS (no setuid binary can give root back) and a parent-death signal.
- The worker reads stdout/stderr while the child runs, keeping only the first
  `4 * max_output_chars` bytes and counting the rest, so printing 100 MB costs pipe bandwidth, not
  memory, and never blocks the child on a full pipe.
- The child writes `S` on the result pipe (its highest allowed fd) just before user code starts and a JSON result after it
  ends. No `S` means the sandbox itself failed (an infrastructure error, retried by the pool);
  `S` without a result means the user code ended the process itself (os._exit, a signal).
- Wall clock: the deadline runs from the fork. On timeout, and after every execution, every process
  of the sandbox uid is killed (`reap_uid`); without root, the child's process group is killed.
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

from cleaner.engine.collect import sandbox_child, sandbox_worker

RESULT_LOST_EXIT = 1  # exit code of a child whose code failed but whose result pipe the code closed
SETUP_FAILED_EXIT = 121  # exit code of a child whose confinement failed before user code ran
DRAIN_GRACE_S = 1.0  # after the kill, how long to wait for the output pipes to close
CHUNK_BYTES = 1 << 16
POLL_S = 0.002  # child-exit polling period where pidfd_open is missing
REPORTED = 0  # the "wait status" of a child that reported its result and closed its pipes
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             **sandbox_worker.SINGLE_THREAD_ENV}


# ---------------------------------------------------------------------------------------------
# Child side (runs after fork; never returns)


def _place_fds(stdin_fd: int, out_w: int, err_w: int, result_w: int, result_fd: int) -> None:
    """fds 0-2 and the result pipe at `result_fd` (the highest fd allowed, out of the way of the
    user's own files); every other fd is closed."""
    high = [os.dup(fd) for fd in (stdin_fd, out_w, err_w, result_w)]  # dodge clashes with targets
    for target, fd in zip((0, 1, 2, result_fd), high, strict=True):
        os.dup2(fd, target)
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _set_limits(config) -> None:
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


def _confine(config, uid: int | None, workdir: str) -> None:
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
    libc = sandbox_worker._libc
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    _set_limits(config)


def _child_main(code: str, config, uid: int | None, workdir: str, fds: tuple[int, ...]) -> None:
    result_fd = config.max_open_files - 1
    _place_fds(*fds, result_fd)
    _confine(config, uid, workdir)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.path.insert(0, workdir)
    sys.argv = [""]
    if "numpy.random" in sys.modules:  # `random` reseeds itself after fork; numpy does not
        sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))
    os.write(result_fd, b"S")
    error_type, error_text = sandbox_child.execute_user_code(code)
    sandbox_child.flush_standard_streams()
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


class _Capture:
    """The head of one stream plus a count of the bytes dropped after it."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes, self.head, self.dropped_bytes = keep_bytes, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = max(0, self.keep_bytes - len(self.head))
        self.head += chunk[:room]
        self.dropped_bytes += len(chunk) - min(room, len(chunk))


def truncate_text(capture: _Capture, max_chars: int) -> str:
    """Decoded head, cut to max_chars with a `...[truncated N chars]` marker (N counts dropped bytes
    beyond the kept head as one char each)."""
    text = capture.head.decode("utf-8", errors="replace")
    extra = len(text) - max_chars if len(text) > max_chars else 0
    dropped = extra + capture.dropped_bytes
    if dropped == 0:
        return text
    return f"{text[:max_chars]}...[truncated {dropped} chars]"


def _pump(streams: dict[int, _Capture], timeout_s: float, extra_fds: tuple[int, ...] = ()) -> list[int]:
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


def _supervise(pid: int, streams: dict[int, _Capture], result_fd: int, deadline: float) -> int | None:
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


def _kill_everything(pid: int, uid: int | None, collect_child: bool) -> None:
    """Kill every process of the execution; if the child was not yet waited for, wait for it."""
    if uid is not None:
        sandbox_worker.reap_uid(uid)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if collect_child:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # already collected with the orphans
    if sandbox_worker.is_subreaper:
        sandbox_worker.reap_zombies()


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


def _classify(wait_status: int | None, result: bytes, config) -> tuple[str, str | None, str | None]:
    """(status, error_type, error_text) from the wait status and the result pipe's bytes."""
    if wait_status is None:
        return "timeout", "Timeout", f"Timeout: execution exceeded the {config.timeout_s:g} s time limit"
    if not result.startswith(b"S"):
        return "infra_error", "InfraError", f"sandbox child failed before running code (status {wait_status})"
    outcome = _parse_outcome(result)
    if outcome is not None:
        if outcome["error_type"] is None:
            return "ok", None, None
        return "error", outcome["error_type"], outcome["error_text"]
    if os.WIFSIGNALED(wait_status):
        signal_number = os.WTERMSIG(wait_status)
        if signal_number == signal.SIGXCPU:
            return "timeout", "Timeout", f"Timeout: CPU time limit of {config.cpu_time_s} s exceeded"
        name = signal.Signals(signal_number).name
        return "error", name, f"{name}: the process was killed by signal {name}"
    exit_code = os.waitstatus_to_exitcode(wait_status)
    if exit_code == 0:
        return "ok", None, None
    return "error", "SystemExit", f"SystemExit: the process exited with code {exit_code}"


def _stdin_fd(stdin: str | None) -> int:
    if stdin is None:
        return os.open(os.devnull, os.O_RDONLY)
    fd = os.memfd_create("stdin")
    os.write(fd, stdin.encode("utf-8"))  # a memfd write never blocks
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def execute(code: str, stdin: str | None, config, uid: int | None, root: str) -> tuple[dict, Callable]:
    """Run one snippet in a fresh confined child: (the reply for the pool, a clean-up to run after
    sending it). The clean-up kills every leftover process of the execution before the next one."""
    workdir = os.path.join(root, uuid.uuid4().hex)
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    (out_r, out_w), (err_r, err_w), (result_r, result_w) = os.pipe(), os.pipe(), os.pipe()
    stdin_fd = _stdin_fd(stdin)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child_main(code, config, uid, workdir, (stdin_fd, out_w, err_w, result_w))
        except BaseException as error:  # noqa: BLE001 - reported on stderr, classified infra_error
            os.write(2, f"sandbox child set-up failed: {error!r}".encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    for fd in (stdin_fd, out_w, err_w, result_w):
        os.close(fd)
    keep_bytes = 4 * config.max_output_chars
    streams = {out_r: _Capture(keep_bytes), err_r: _Capture(keep_bytes), result_r: _Capture(1 << 20)}
    captures = dict(zip(("stdout", "stderr", "result"), streams.values(), strict=True))
    wait_status = _supervise(pid, streams, result_r, start + config.timeout_s)
    exec_ms = (time.monotonic() - start) * 1000.0
    for _ in range(64):  # usually every pipe is at EOF once the child is gone
        if not streams or not select.select(list(streams), [], [], 0)[0]:
            break
        _pump(streams, 0)
    killed_before_reply = bool(streams) or wait_status is None
    if killed_before_reply:  # something still holds the pipes (or runs past the deadline)
        _kill_everything(pid, uid, collect_child=True)
        drain_deadline = time.monotonic() + DRAIN_GRACE_S
        while streams and time.monotonic() < drain_deadline:
            _pump(streams, drain_deadline - time.monotonic())
    for fd in streams:
        os.close(fd)

    def clean_up() -> None:
        """Run after the reply is sent: kill whatever is left of the execution, remove its workdir."""
        if not killed_before_reply:
            _kill_everything(pid, uid, collect_child=True)  # waitpid: harmless if already collected
        shutil.rmtree(workdir, ignore_errors=True)

    return _reply(wait_status, captures, exec_ms, config), clean_up


def _reply(wait_status: int | None, captures: dict, exec_ms: float, config) -> dict:
    status, error_type, error_text = _classify(wait_status, bytes(captures["result"].head), config)
    stderr = truncate_text(captures["stderr"], config.max_output_chars)
    if error_text:
        stderr = f"{stderr.rstrip(chr(10))}\n{error_text}" if stderr.strip() else error_text
    return {"status": status, "error_type": error_type, "exec_ms": exec_ms, "stderr": stderr,
            "stdout": truncate_text(captures["stdout"], config.max_output_chars)}
