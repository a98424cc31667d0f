"""One process at a time: an exclusive `flock` on a lock file, released by the kernel if the
holder dies (so a SIGKILLed process never leaves a stale lock behind).

Used by `cleaner compact` (one compaction of a warehouse at a time) and `cleaner run` (one job,
through its rank 0, drives a run directory: two would collect the same iteration twice).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from cleaner.warehouse.parts import WarehouseError


@contextlib.contextmanager
def exclusive(path: Path, busy: str) -> Iterator[None]:
    """Hold the lock file `path` (created if missing) for the block; WarehouseError(`busy`) if
    another process holds it."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise WarehouseError(busy) from error
        yield  # closing the file releases the lock
