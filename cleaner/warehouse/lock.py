"""Writer locks: one process at a time holds a lock file, and says who it is.

Used by `cleaner compact` (one compaction of a warehouse at a time), `cleaner run` and `demo` (one
job, through its rank 0, drives a run directory) and the phase jobs (one writer per warehouse
iteration and phase: `Warehouse.writer`, docs/architecture.md §3).

Design decisions:
- The lock is an `flock` on the lock file, which the kernel releases when the holder's process
  ends, however it ends: a SIGKILLed holder never leaves a lock anyone must remove by hand.
- The holder writes who it is into the file (pid, host, since when, its command), so a process
  refused the lock names the holder in its one error line. A holder that ends normally empties the
  file; one that died leaves its record, so the next taker sees it and logs that it took over the
  lock of a process that is gone (the kernel's release is the proof, not the pid: a pid can be
  reused, and another host's pid cannot be checked).
- Lock files are never deleted: removing a file another process has open and locked would let a
  third lock a new file of the same name while the second still holds the old one.
- A share lock (`shared=True`) is held by many at once and excludes an exclusive holder: shards of
  one iteration collect side by side, an unsharded writer waits for none of them. Many holders
  share one file, so a share lock records nobody; the shard locks beside it name them.
- flock binds across hosts on local and NFS file systems (Linux sends it to the NFS server's lock
  manager); a file system that ignores locks cannot give this guarantee.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from cleaner.errors import write_error
from cleaner.warehouse.parts import WarehouseError

logger = logging.getLogger(__name__)

LOCKS_DIR = ".locks"  # in a warehouse: the writer locks of its iterations' phases
RUN_LOCK = ".run.lock"  # in a run directory: one job (its rank 0) drives a run
# What each phase's writer is doing, and what a refused one can do instead.
PHASES = {
    "collect": ("collecting", "wait for it to end (then --resume finishes what is left), or collect another --iteration"),
    "purify": ("purifying", "wait for it to end, then run this again: the rows it stored are kept, not recomputed"),
    "train": ("training on", "wait for it to end; training the same config into the same --out again replaces "
                             "its train_steps rows"),
}


class LockHeld(WarehouseError):
    """Another process holds the lock; the message names it and what to do."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock file, as it wrote itself there."""

    pid: int
    host: str
    since: str  # local time the lock was taken, ISO 8601 to the second
    command: str  # the holder's command line, shortened

    @classmethod
    def me(cls) -> Holder:
        program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
        if program == "__main__.py":  # python -m cleaner (or cleaner.cli)
            program = "cleaner"
        command = " ".join([program, *sys.argv[1:]])
        return cls(os.getpid(), socket.gethostname(), datetime.now().isoformat(timespec="seconds"),
                   command[:200])

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder recorded in a lock file's text; None if it records none (free, or a share lock)."""
        try:
            record = json.loads(text)
            return cls(int(record["pid"]), str(record["host"]), str(record["since"]), str(record["command"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.since.replace('T', ' ')}: {self.command}"


def holder_of(path: Path) -> Holder | None:
    """Who holds the lock file `path` by its record (None when it records nobody)."""
    try:
        return Holder.parse(path.read_text())
    except OSError:
        return None


def refusal(path: Path, what: str, advice: str) -> str:
    """The one line a process refused `path` prints: what is busy, who holds it, what to do."""
    holder = holder_of(path)
    held = f"{path.name}: {holder.describe()}" if holder else path.name
    return f"{what} (it holds {held}); {advice}"


def run_lock(run_dir: Path) -> tuple[Path, str, str]:
    """The run directory's lock file, what a refused job is told is busy, and what to do."""
    return (run_dir / RUN_LOCK, f"{run_dir}: another process is running this run",
            "wait for it to end, or choose another --run-dir")


def refusal_if_held(path: Path, what: str, advice: str, *, shared: bool = False) -> str | None:
    """The line `exclusive` would refuse with if another process holds `path` now, else None: an
    early answer for a command that loads a model before it takes its lock (which may still be
    refused then, if another process took it meanwhile). `shared`: only an exclusive holder counts
    (shards of an iteration hold its lock shared)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: nobody holds it
    try:
        fcntl.flock(descriptor, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return refusal(path, what, advice)
    finally:
        os.close(descriptor)  # releases the probe's lock, if it took it
    return None


@contextlib.contextmanager
def exclusive(path: Path, what: str, advice: str, *, shared: bool = False, wait: bool = False) -> Iterator[None]:
    """Hold the lock file `path` (created if missing) for the block; LockHeld naming `what`, the
    holder and `advice` if another process holds it, or with `wait` wait for it (module docstring)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise write_error(path, error) from error
    try:  # unbuffered: nothing is left to flush (and fail) on a full disk when the file closes
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
        except BlockingIOError as error:
            if not wait:
                raise LockHeld(refusal(path, what, advice)) from error
            logger.info("waiting: %s", refusal(path, what, "it is waited for"))
            fcntl.flock(descriptor, mode)
        if not shared:
            _record(descriptor, path)
        try:
            yield
        finally:
            if not shared:
                with contextlib.suppress(OSError):
                    os.ftruncate(descriptor, 0)  # ended normally: the file records nobody
    finally:
        os.close(descriptor)  # releases the lock


def _record(descriptor: int, path: Path) -> None:
    """Write this process into the lock file it now holds, after logging a dead holder's record."""
    previous = Holder.parse(os.pread(descriptor, 4096, 0).decode(errors="replace"))
    if previous is not None:
        logger.warning("took over %s from %s (that process is gone)", path, previous.describe())
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(asdict(Holder.me())) + "\n").encode(), 0)
    except OSError as error:  # a full disk: the lock holds all the same, it only names nobody
        logger.debug("cannot record the holder of %s: %s", path, error)


# ---------------------------------------------------------------------------------------------
# One writer per warehouse iteration and phase


def phase_lock_path(root: Path, phase: str, iteration: int, share: tuple[int, int] | None = None) -> Path:
    """The lock file of a phase's writers of an iteration, or of one shard (index, count) of it."""
    name = f"{phase}-iteration={iteration}" + (f"-shard={share[0]}of{share[1]}" if share else "")
    return root / LOCKS_DIR / f"{name}.lock"


@contextlib.contextmanager
def phase_lock(root: Path, phase: str, iteration: int, share: tuple[int, int] | None = None) -> Iterator[None]:
    """Hold the writer lock of `phase` on `iteration` for the block: the whole iteration, or with
    `share` = (index, count) one shard of it. Shards of one iteration run side by side; a second
    writer of the same shard, or an unsharded writer beside any shard, gets LockHeld at once."""
    doing, advice = PHASES[phase]
    whole = phase_lock_path(root, phase, iteration)
    what = f"{root}: another process is {doing} iteration {iteration}"
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive(whole, what, advice, shared=share is not None))
        except LockHeld as error:
            if share is None and holder_of(whole) is None:  # shards hold it: name them
                raise LockHeld(_shards_refusal(root, phase, iteration, what, advice)) from error
            raise
        if share is not None:
            held.enter_context(exclusive(phase_lock_path(root, phase, iteration, share),
                                         f"{what} shard {share[0]}/{share[1]}", advice))
        yield


def collect_refusal(root: Path, iteration: int, share: tuple[int, int] | None, advice: str) -> str | None:
    """The line a reader of `iteration` (or of one shard (index, count) of it) says while a
    collection writes what it would read, else None: for the whole iteration any collect of it,
    a shard's or not; for a shard, a collect of that shard or an unsharded one."""
    what = f"{root}: iteration {iteration} is being collected"
    if share is not None:
        held = refusal_if_held(phase_lock_path(root, "collect", iteration, share),
                               f"{what} (shard {share[0]}/{share[1]})", advice)
        return held or refusal_if_held(phase_lock_path(root, "collect", iteration), what, advice, shared=True)
    whole = phase_lock_path(root, "collect", iteration)
    held = refusal_if_held(whole, what, advice)
    if held and holder_of(whole) is None:  # shards hold it, shared: name them
        return _shards_refusal(root, "collect", iteration, what, advice)
    return held


@contextlib.contextmanager
def purified_write_lock(root: Path, iteration: int) -> Iterator[None]:
    """Hold, waiting for it, the lock under which a purify writes an iteration's rows: it finds
    which rollouts have rows under a config and writes the others, and no other process may do
    the same meanwhile (writers that hold the iteration's purify lock of different shards could)."""
    path = root / LOCKS_DIR / f"purified-write-iteration={iteration}.lock"
    with exclusive(path, f"{root}: another process is writing purified rows of iteration {iteration}", "", wait=True):
        yield


def _shards_refusal(root: Path, phase: str, iteration: int, what: str, advice: str) -> str:
    shards = sorted((root / LOCKS_DIR).glob(f"{phase}-iteration={iteration}-shard=*.lock"))
    holders = [f"{path.name}: {holder.describe()}" for path in shards if (holder := holder_of(path))]
    return f"{what} (shards of it hold {', '.join(holders) or phase_lock_path(root, phase, iteration).name}); {advice}"


def remove_if_only_locks(root: Path, created: list[Path]) -> None:
    """Remove the directories `created` (innermost first) for a warehouse `root` that holds nothing
    but free writer locks: a job that failed before its first write leaves nothing behind. A lock
    file that records a holder, or anything else in `root`, keeps everything."""
    locks = root / LOCKS_DIR
    if not created or not root.is_dir() or [entry.name for entry in root.iterdir()] != [LOCKS_DIR]:
        return
    files = list(locks.iterdir())
    if any(not path.name.endswith(".lock") or holder_of(path) is not None for path in files):
        return
    for path in files:
        path.unlink()
    locks.rmdir()
    remove_directories(created)


def missing_directories(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, innermost first: what creating it
    creates."""
    return [directory for directory in (path, *path.parents) if not directory.exists()]


def remove_directories(created: list[Path]) -> None:
    """Remove `created` (innermost first) as long as each is empty; stop at the first that is not."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return
