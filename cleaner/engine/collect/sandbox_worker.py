"""Warm worker of the local sandbox: a long-lived process that forks one fresh child per execution.

Started by `LocalSandbox` as `python -m cleaner.engine.collect.sandbox_worker '<SandboxConfig JSON>'`.
It talks to the pool over its stdin/stdout with length-prefixed JSON messages (`send_message`,
`receive_message`) and never prints anything else there.

Design decisions:
- Warm: common modules (`WARM_IMPORTS`; with `preload_scientific` also numpy and sympy) are
  imported once at start-up, so a snippet pays no interpreter start (~30 ms) and no
  `import sympy` (~0.3 s). The cost: fork and exit scale with the worker's resident memory, so the
  scientific preload makes every execution's CPU cost higher (BENCHMARKS.md, "Sandbox"); the
  spare child (sandbox_exec.py) keeps the fork itself off the latency path. BLAS thread
  pools are pinned to one thread before any import, so the worker stays single-threaded and
  fork-safe; `gc.freeze()` keeps the warm objects out of the children's collections.
- Fresh child per execution: state never leaks between executions; the child runs with its own
  session, a private working directory, resource limits and (as root) an unprivileged uid.
- Isolation set up once per worker (when running as root): a private network namespace (only a
  downed loopback, so no connection goes anywhere) and a private mount namespace in which /tmp is a
  size-limited tmpfs (mode 0711, holding the 0700 per-execution workdirs) and /var/tmp, /run/lock
  and /dev/shm are tmpfs that the sandbox user cannot write.
- One uid per worker, unique across every pool on the host: slot `61000 + k` is claimed with an
  flock on a lock file held for the worker's lifetime. RLIMIT_NPROC then binds per worker (a fork
  bomb in one worker cannot starve another), and "everything of an execution" is exactly the
  processes of that uid: a forked reaper setuid()s to it and repeats kill(-1, SIGKILL). The worker
  is a child subreaper, so the orphans are reaped here and never pile up as zombies against the quota.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import pwd
import shutil
import struct
import sys
import tempfile

UID_BASE = 61000  # first sandbox uid
UID_SLOTS = 2000  # uids UID_BASE .. UID_BASE + UID_SLOTS - 1 may be claimed
LOCK_DIR = os.path.join(tempfile.gettempdir(), "cleaner-sandbox-uids")  # flock files, one per uid
WARM_IMPORTS = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
    "bisect", "re", "string", "json", "random", "statistics", "operator", "datetime", "time", "copy",
    "typing", "ast", "base64", "builtins", "io", "signal", "resource", "shutil", "uuid", "select",
)
SCIENTIFIC_WARM_IMPORTS = ("numpy", "numpy.random", "sympy")  # with preload_scientific, if installed
SINGLE_THREAD_ENV = {name: "1" for name in (
    "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")}

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE = 1 << 14, 1 << 18
PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct("<I")


# ---------------------------------------------------------------------------------------------
# Framing


def send_message(fd: int, message: dict) -> None:
    payload = json.dumps(message).encode("utf-8")
    data = _HEADER.pack(len(payload)) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def receive_message(fd: int) -> dict | None:
    """The next message, or None at end of stream."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if payload is None else json.loads(payload)


# ---------------------------------------------------------------------------------------------
# Isolation set-up (root only; each step that the OS refuses is reported, not fatal)

_libc = ctypes.CDLL(None, use_errno=True)


def _libc_call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


def _is_account(uid: int) -> bool:
    """True if `uid` belongs to a real account, which a sandbox must never impersonate."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def claim_uid(preferred: int | None) -> tuple[int, int]:
    """Lock a free sandbox uid; returns (uid, lock fd). The lock lives as long as the fd."""
    os.makedirs(LOCK_DIR, mode=0o755, exist_ok=True)
    start = preferred - UID_BASE if preferred is not None else (os.getpid() % UID_SLOTS)
    for offset in range(UID_SLOTS):
        uid = UID_BASE + (start + offset) % UID_SLOTS
        if _is_account(uid):
            continue
        fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise RuntimeError(f"all {UID_SLOTS} sandbox uids from {UID_BASE} are in use")


def _mount_tmpfs(target: str, options: str) -> None:
    _libc_call("mount", b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())


def _hidden_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` (or itself) that other users cannot traverse, if any."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    for depth in range(1, len(parts) + 1):
        ancestor = os.sep + os.sep.join(parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def expose_python(paths: list[str]) -> None:
    """Make the interpreter's directories reachable by the sandbox uid inside this mount namespace.

    pyenv installs Python under /root (mode 0700), where an unprivileged child could not import
    anything not already imported. For each such hidden ancestor (e.g. /root): remember the needed
    directories, cover the ancestor with an empty tmpfs (hiding the rest of it), and bind the needed
    directories back read-only. The host's permissions are untouched.
    """
    needed: dict[str, list[tuple[str, int]]] = {}
    for path in dict.fromkeys(os.path.realpath(p) for p in paths if os.path.isdir(p)):
        ancestor = _hidden_ancestor(path)
        if ancestor is not None:
            needed.setdefault(ancestor, []).append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    for ancestor, entries in needed.items():
        _mount_tmpfs(ancestor, "size=1m,mode=0755")
        _bind_back_read_only(entries)


def _bind_back_read_only(entries: list[tuple[str, int]]) -> None:
    """Bind each directory (held open as an O_PATH fd) back at its path, read-only."""
    for path, fd in entries:
        os.makedirs(path, mode=0o755, exist_ok=True)
        source = f"/proc/self/fd/{fd}".encode()
        _libc_call("mount", source, path.encode(), None, MS_BIND | MS_REC, None)
        _libc_call("mount", None, path.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        os.close(fd)


def _open_paths_under(root: str, paths: list[str]) -> list[tuple[str, int]]:
    """O_PATH fds of the existing directories strictly below `root` (to survive covering it)."""
    real = dict.fromkeys(os.path.realpath(p) for p in paths if os.path.isdir(p))
    return [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in real if p.startswith(root.rstrip("/") + "/")]


def _python_paths() -> list[str]:
    executable_dir = os.path.dirname(os.path.realpath(sys.executable))
    return [executable_dir, sys.prefix, sys.base_prefix, *[p for p in sys.path if p]]


def isolate(config) -> dict:
    """Private network and mount namespaces; returns what is in effect."""
    report = {"network_isolated": False, "filesystem_isolated": False}
    try:
        _libc_call("unshare", CLONE_NEWNET)
        report["network_isolated"] = True
    except OSError as error:
        print(f"sandbox worker: no network namespace ({error})", file=sys.stderr)
    try:
        _libc_call("unshare", CLONE_NEWNS)
        _libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        expose_python(_python_paths())
        # A virtualenv or checkout under /tmp (CI often clones there) must stay importable once the
        # private tmpfs covers /tmp: bind those directories back, read-only, inside it.
        python_under_tmp = _open_paths_under("/tmp", _python_paths())
        workdir_mb = max(64, 4 * config.max_file_size_mb)
        _mount_tmpfs("/tmp", f"size={workdir_mb}m,mode=0711")
        _bind_back_read_only(python_under_tmp)
        for path in ("/var/tmp", "/run/lock", "/dev/shm"):
            if os.path.isdir(path):
                _mount_tmpfs(path, "size=1m,mode=0755")
        report["filesystem_isolated"] = True
    except OSError as error:
        print(f"sandbox worker: no private /tmp ({error})", file=sys.stderr)
    return report


def _kill_all_as(uid: int) -> None:
    """Fork a reaper that becomes `uid` and SIGKILLs every process of that uid; wait for it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(64):  # kill(-1) is atomic with respect to fork; repeat for stragglers
                os.kill(-1, 9)
        except ProcessLookupError:
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked reaper must never return into its parent
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)


class ReaperServer:
    """A small root process, forked before the warm imports, that runs `_kill_all_as` on request.

    Forking and tearing down a copy of the warm worker (~70 MB with numpy and sympy) costs several
    ms; forking this ~12 MB process costs a fraction of that, on every execution.
    """

    def __init__(self, uid: int) -> None:
        self.uid = uid
        request_r, self.request_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self.request_w)
                os.close(self.ack_r)
                _libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
                while os.read(request_r, 1):
                    _kill_all_as(uid)
                    os.write(ack_w, b"k")
            finally:
                os._exit(0)
        os.close(request_r)
        os.close(ack_w)

    def reap(self) -> None:
        try:
            os.write(self.request_w, b"r")
            if os.read(self.ack_r, 1) == b"k":
                return
        except OSError:
            pass
        _kill_all_as(self.uid)  # the server is gone: do it the slow way


_reaper: ReaperServer | None = None
is_subreaper = False  # True in a worker process: orphans are ours to reap (never in a host process)


def reap_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (as that uid), then reap the orphans that came to us."""
    if _reaper is not None and _reaper.uid == uid:
        _reaper.reap()
    else:
        _kill_all_as(uid)
    if is_subreaper:
        reap_zombies()


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---------------------------------------------------------------------------------------------
# Main loop


def _warm_up(preload_scientific: bool) -> None:
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    for name in SCIENTIFIC_WARM_IMPORTS if preload_scientific else ():
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _take_protocol_fds() -> tuple[int, int]:
    """Move the protocol off fds 0/1 so that nothing else can ever write into it."""
    request_fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 10)
    reply_fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 10)
    null_fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(null_fd, 0)
    os.dup2(2, 1)
    os.close(null_fd)
    return request_fd, reply_fd


def main(argv: list[str]) -> int:
    os.environ.update(SINGLE_THREAD_ENV)
    from cleaner.engine.collect import sandbox_exec
    from cleaner.engine.config import SandboxConfig

    config = SandboxConfig(**json.loads(argv[1]))
    preferred_uid = int(argv[2]) if len(argv) > 2 and argv[2] != "-" else None
    request_fd, reply_fd = _take_protocol_fds()
    privileged = os.geteuid() == 0
    _libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of executions come here
    global is_subreaper
    is_subreaper = True
    uid, report = None, {"network_isolated": False, "filesystem_isolated": False}
    if privileged:
        uid, _lock_fd = claim_uid(preferred_uid)
        report = isolate(config)
        reap_uid(uid)  # leftovers of a previous worker that held this uid
        global _reaper
        _reaper = ReaperServer(uid)
    root = "/tmp" if report["filesystem_isolated"] else tempfile.mkdtemp(prefix="cleaner-sandbox-")
    _warm_up(config.preload_scientific)
    gc.freeze()  # keep the warm objects out of the children's collections: no copy-on-write storm
    executor = sandbox_exec.Executor(config, uid, root)
    send_message(reply_fd, {"pid": os.getpid(), "uid": uid, **report})
    while True:
        request = receive_message(request_fd)
        if request is None or request.get("op") == "exit":
            break
        reply, clean_up = executor.execute(request["code"], request.get("stdin"))
        try:
            send_message(reply_fd, reply)
        except BrokenPipeError:
            break
        finally:
            clean_up()
    executor.close()
    if uid is not None:
        reap_uid(uid)
    if not report["filesystem_isolated"]:
        shutil.rmtree(root, ignore_errors=True)  # a host directory; the private /tmp vanishes by itself
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this `__main__` copy's: the worker's state (`_reaper`,
    # `is_subreaper`) must live in the module that sandbox_exec sees.
    from cleaner.engine.collect import sandbox_worker

    sys.exit(sandbox_worker.main(sys.argv))
