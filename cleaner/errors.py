"""The one base class of expected failures.

A `CleanerError` is bad input or an unusable environment, never a bug: its message names the input
(a file, a directory, an option) and what was expected. The CLI prints it as one `error: ...` line
and exits with its `exit_code` (1, or 130 for a Ctrl-C); anything else that escapes is a bug and
keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path


class CleanerError(Exception):
    """An expected failure; the message says which input and what was expected."""

    exit_code = 1


class JobError(CleanerError):
    """A job cannot start or finish; the message says why and what to do."""


class CollectionStopped(JobError):
    """A collection ended before every planned rollout was stored (infrastructure faults): the
    message says why, what is committed, and that `--resume` finishes it."""


class Stopped(CleanerError):
    """A Ctrl-C stopped the command (cleaner/interrupts.py); the message says what is kept."""

    exit_code = 130  # as a shell reports a command that SIGINT ended


class Interrupted(CollectionStopped, Stopped):
    """A Ctrl-C stopped a collection; the parts finished before it are committed."""

    exit_code = 130


# ---------------------------------------------------------------------------------------------
# Failed writes: a full disk, a quota, a read-only file system, a permission


class WriteError(CleanerError):
    """A file or directory could not be written; the message names it, why, and what to free."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 2**20  # a write that failed with less than this free failed for want of space
# What serialisers say when a write of theirs fails without an errno (torch's zip writer: "[enforce
# fail at inline_container.cc] ... unexpected pos"); a chunk of one may be large, so with less than
# _STREAM_FULL_BYTES free such a failure is taken for a full disk too.
_STREAM_WRITE_FAILED = ("unexpected pos", "failed writing file", "no space left")
_STREAM_FULL_BYTES = 2**30


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path` itself if it exists, else its nearest existing parent directory."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def read_only_file_system(path: str | os.PathLike) -> bool:
    """Whether the file system holding `path` (an existing path) is mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes this process may still write on the file system that holds (or would hold) `path`."""
    return shutil.disk_usage(existing_ancestor(path)).free


def mount_point(path: str | os.PathLike) -> Path:
    path = existing_ancestor(path)
    return next(p for p in (path, *path.parents) if os.path.ismount(p))


def writer_gone(host: str, pid: str) -> bool:
    """Whether the writer a temporary's name records (`host`, `pid` as text) is a process of this
    host that has ended, so what it left may go. Another host's process cannot be checked: it stays."""
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False


def is_disk_full(error: BaseException, path: str | os.PathLike) -> bool:
    """Whether `error` (from writing under `path`) is a full disk or quota: the first OSError with an
    errno in its chain says ENOSPC or EDQUOT; without one, whether the file system has (almost)
    nothing free, which is how torch and safetensors report it (a RuntimeError naming no errno), or,
    for a serialiser's failed stream write, less than a large chunk of it."""
    seen: BaseException | None = error
    stream_failed = False
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno in DISK_FULL
        stream_failed = stream_failed or any(text in str(seen).lower() for text in _STREAM_WRITE_FAILED)
        seen = seen.__cause__ or seen.__context__
    try:
        return free_bytes(path) < (_STREAM_FULL_BYTES if stream_failed else _NEARLY_FULL_BYTES)
    except OSError:
        return False


def write_error(path: str | os.PathLike, error: BaseException, needed: int | None = None) -> WriteError:
    """The one-line error for a failed write of `path`: why, and what to free for a full disk."""
    if not is_disk_full(error, path):
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return WriteError(f"{path}: cannot write it ({why})")
    try:
        where = f"the file system at {mount_point(path)} has {human_bytes(free_bytes(path))} free"
    except OSError:
        where = "its file system is full"
    wanted = f"at least {human_bytes(needed)} " if needed else ""
    return WriteError(f"{path}: cannot write it, no space left on the device ({where}); free {wanted}space "
                      "there, or write elsewhere, and run the command again (what was written before stays)")
