"""Operating-system isolation of the local sandbox: uids, namespaces, and killing what an execution left.

Everything here needs Linux; the parts that need root are only called when running as root, and
each step the OS refuses is reported, not fatal (the worker says in its hello what is in effect).

Design decisions:
- One uid per worker, unique across every pool on the host: slot `UID_BASE + k` is claimed with an
  flock on a lock file held for the worker's lifetime (`claim_uid`), skipping uids of real
  accounts, which a sandbox must never impersonate. RLIMIT_NPROC then binds per worker (a fork bomb
  in one worker cannot starve another), and "everything of an execution" is exactly the processes
  of that uid.
- Killing by uid: a forked process setuid()s to the sandbox uid and repeats kill(-1, SIGKILL)
  (`kill_all_as`); kill(-1) as that uid reaches every process of the uid and nothing else. The
  worker forks a small `ReaperServer` before its warm imports to do this on request, so the fork on
  every execution is of a small process, not of the warm worker.
- The worker is a child subreaper: the orphans of its executions are re-parented to it and reaped
  there (`Reaper`), so they never pile up as zombies against the uid's process quota. The state
  that says so lives in a `Reaper` object handed to whoever kills, never in module globals.
- Namespaces (`isolate`), set up once per worker: a private network namespace (only a downed
  loopback, so no connection goes anywhere) and a private mount namespace in which /tmp is a
  size-limited tmpfs (mode 0711, holding the 0700 per-execution workdirs) and /var/tmp, /run/lock
  and /dev/shm are tmpfs that the sandbox user cannot write.
- An interpreter installed under a directory others cannot enter (pyenv's /root) is bound back
  read-only over an empty tmpfs there (`expose_python`), so the sandbox uid can import from it and
  the rest of that directory stays hidden. The host's permissions are untouched.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pwd
import signal
import sys
import tempfile
from dataclasses import dataclass

UID_BASE = 61000  # first sandbox uid
UID_SLOTS = 2000  # uids UID_BASE .. UID_BASE + UID_SLOTS - 1 may be claimed
LOCK_DIR = os.path.join(tempfile.gettempdir(), "cleaner-sandbox-uids")  # flock files, one per uid

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE = 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38


# ---------------------------------------------------------------------------------------------
# libc


# The C library, for the calls `os` does not wrap (mount, unshare, prctl). Opened at import, so a
# forked child never has to run the dynamic loader.
LIBC = ctypes.CDLL(None, use_errno=True)


def libc_call(name: str, *args) -> None:
    """Call libc's `name`; raise OSError (with errno's message) if it does not return 0."""
    if getattr(LIBC, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


def become_subreaper() -> None:
    """Orphaned descendants of this process are re-parented to it (PR_SET_CHILD_SUBREAPER)."""
    libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# Sandbox uids


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


# ---------------------------------------------------------------------------------------------
# Namespaces


@dataclass(frozen=True)
class Isolation:
    """What `isolate` put in effect."""

    network_isolated: bool  # private network namespace
    filesystem_isolated: bool  # private /tmp (and unwritable /var/tmp, /run/lock, /dev/shm)


NO_ISOLATION = Isolation(network_isolated=False, filesystem_isolated=False)


def _mount_tmpfs(target: str, options: str) -> None:
    libc_call("mount", b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())


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
        libc_call("mount", source, path.encode(), None, MS_BIND | MS_REC, None)
        libc_call("mount", None, path.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        os.close(fd)


def _open_paths_under(root: str, paths: list[str]) -> list[tuple[str, int]]:
    """O_PATH fds of the existing directories strictly below `root` (to survive covering it)."""
    real = dict.fromkeys(os.path.realpath(p) for p in paths if os.path.isdir(p))
    return [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in real if p.startswith(root.rstrip("/") + "/")]


def python_paths() -> list[str]:
    """The directories this interpreter imports from, this package's `cleaner` directory included:
    an editable install imports it from the checkout, which is not on sys.path."""
    executable_dir = os.path.dirname(os.path.realpath(sys.executable))
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [executable_dir, sys.prefix, sys.base_prefix, package_dir, *[p for p in sys.path if p]]


def isolate(max_file_size_mb: int) -> Isolation:
    """Private network and mount namespaces for this process; returns what is in effect."""
    network_isolated = filesystem_isolated = False
    try:
        libc_call("unshare", CLONE_NEWNET)
        network_isolated = True
    except OSError as error:
        print(f"sandbox worker: no network namespace ({error})", file=sys.stderr)
    try:
        libc_call("unshare", CLONE_NEWNS)
        libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        expose_python(python_paths())
        # A virtualenv or checkout under /tmp (CI often clones there) must stay importable once the
        # private tmpfs covers /tmp: bind those directories back, read-only, inside it.
        python_under_tmp = _open_paths_under("/tmp", python_paths())
        workdir_mb = max(64, 4 * max_file_size_mb)
        _mount_tmpfs("/tmp", f"size={workdir_mb}m,mode=0711")
        _bind_back_read_only(python_under_tmp)
        for path in ("/var/tmp", "/run/lock", "/dev/shm"):
            if os.path.isdir(path):
                _mount_tmpfs(path, "size=1m,mode=0755")
        filesystem_isolated = True
    except OSError as error:
        print(f"sandbox worker: no private /tmp ({error})", file=sys.stderr)
    return Isolation(network_isolated, filesystem_isolated)


# ---------------------------------------------------------------------------------------------
# Killing and reaping


def kill_all_as(uid: int) -> None:
    """Fork a reaper that becomes `uid` and SIGKILLs every process of that uid; wait for it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(64):  # kill(-1) is atomic with respect to fork; repeat for stragglers
                os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked reaper must never return into its parent
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)


def reap_zombies() -> None:
    """Collect every child of this process that has already exited; never blocks."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class ReaperServer:
    """A small root process, forked before the warm imports, that runs `kill_all_as` on request:
    forking and tearing down a copy of the warm worker (numpy and sympy loaded) costs far more than
    forking this one, and it happens after every execution."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        request_r, self.request_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self.request_w)
                os.close(self.ack_r)
                LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the worker
                while os.read(request_r, 1):
                    kill_all_as(uid)
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
        kill_all_as(self.uid)  # the server is gone: do it the slow way


class Reaper:
    """Ends every process of an execution and collects what is left.

    `uid` is the sandbox uid, or None without root (then only the child's process group can be
    killed; a process that calls setsid escapes it). `subreaper` is True in a worker, which made
    itself the child subreaper: orphans are then its own to wait for. A host process running one
    execution directly is not a subreaper and must not wait for children that are not its own.
    """

    def __init__(self, uid: int | None, subreaper: bool = False) -> None:
        self.uid, self.subreaper = uid, subreaper
        self._server: ReaperServer | None = None

    def start_server(self) -> None:
        """Fork the ReaperServer; call before the warm imports, while this process is small."""
        if self.uid is not None:
            self._server = ReaperServer(self.uid)

    def kill_uid(self) -> None:
        """SIGKILL every process of the sandbox uid (as that uid), then reap the orphans."""
        if self._server is not None:
            self._server.reap()
        elif self.uid is not None:
            kill_all_as(self.uid)
        self.reap_orphans()

    def kill_execution(self, pid: int, collect_child: bool) -> None:
        """Kill every process of the execution whose child is `pid`; with `collect_child`, also
        wait for that child (harmless if it was already collected)."""
        if self.uid is not None:
            self.kill_uid()
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
        self.reap_orphans()

    def reap_orphans(self) -> None:
        if self.subreaper:
            reap_zombies()
