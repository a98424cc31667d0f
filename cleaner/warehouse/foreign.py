"""`cleaner warehouse --adopt` and `--remove`: settling a part the warehouse did not write
(docs/architecture.md §3, "Own parts"; ownership.py says how one is told from the warehouse's own).

Design decisions:
- Adopting a part rewrites its rows as a part of the warehouse's own by compaction's protocol
  (`compact.merge_parts`): a merged part, stamped, that lists the adopted file in its footer, so
  from its rename on readers see the rows once, in it; then the file is removed. A collection's
  part is adopted with its twin (a rollouts part and the segments part of its name), the rollouts
  part written last, as compaction commits. The part's bytes are verified first, as any read's.
- Removing deletes the file, and its twin if that is not the warehouse's own either. A part the
  warehouse wrote is never removed or adopted here: these commands settle only what it did not
  write, so a mistyped path cannot delete rows it holds.
- Both hold the compaction lock (one rewrite of parts at a time) and refuse a read-only warehouse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cleaner.errors import read_only_file_system
from cleaner.warehouse.compact import LOCK_NAME, Partition, merge_parts
from cleaner.warehouse.lock import exclusive
from cleaner.warehouse.manifest import Manifest
from cleaner.warehouse.ownership import Ownership, claim
from cleaner.warehouse.parts import PART_GLOB, WarehouseError, fsync_dir
from cleaner.warehouse.schema import COMMITTED_BY, DATASETS, Dataset


@dataclass(frozen=True)
class Settled:
    """What `adopt` or `remove` did to one part."""

    part: Path  # the part named
    files: tuple[Path, ...]  # the files removed (the part, its twin)
    written: tuple[Path, ...]  # the parts that hold its rows now (adopt), else ()


@contextlib.contextmanager
def _settling(root: Path, part: Path) -> Iterator[tuple[Dataset, Path, Ownership]]:
    """`part`'s dataset, partition and the warehouse's owner, under compact's lock, once `part` is
    checked to be a part the warehouse did not write: what adopt and remove both start from."""
    dataset, partition = _located(root, part)
    with exclusive(root / LOCK_NAME, f"{root}: `cleaner compact` (or another adopt or remove) is running",
                   "wait for it to end"):
        owner = claim(root)
        _check_foreign(root, dataset, part, owner)
        yield dataset, partition, owner


def adopt(root: Path, part: Path) -> Settled:
    """Make the rows of `part`, which the warehouse did not write, the warehouse's own."""
    with _settling(root, part) as (dataset, partition, owner):
        marker = COMMITTED_BY.get(dataset.name, dataset)
        unit = Partition(marker, partition, tuple(DATASETS[name] for name, m in COMMITTED_BY.items() if m is marker))
        files = tuple(unit.directory(root, d) / part.name for d in (marker, *unit.twins)
                      if (unit.directory(root, d) / part.name).exists())
        merges = merge_parts(root, unit, [part.name], owner, adopting=True)
    return Settled(part, files, tuple(root / merge.dataset / partition / merge.part for merge in merges))


def remove(root: Path, part: Path) -> Settled:
    """Delete `part`, which the warehouse did not write, and its twin if that is not its own either."""
    with _settling(root, part) as (dataset, partition, owner):
        files = [part]
        twins = [DATASETS[name] for name, marker in COMMITTED_BY.items() if marker is dataset]
        for twin in twins:
            path = root / twin.name / partition / part.name
            if path.exists() and _foreign(root, twin, path, owner):
                files.append(path)
        for path in files:
            path.unlink(missing_ok=True)
            fsync_dir(path.parent)
    return Settled(part, tuple(files), ())


def _located(root: Path, part: Path) -> tuple[Dataset, Path]:
    """The dataset of `part` and its partition directory under the dataset's; WarehouseError unless
    it is a part file of the warehouse at `root` and the warehouse is writable."""
    if not root.is_dir():
        raise WarehouseError(f"{root}: no such warehouse directory")
    if read_only_file_system(root):
        raise WarehouseError(f"{root}: it is on a read-only file system; adopt or remove parts in a writable copy")
    expected = f"expected a file {root}/<dataset>/<partition>/part-*.parquet"
    try:
        relative = part.resolve().relative_to(root.resolve())
    except ValueError as error:
        raise WarehouseError(f"{part}: not in the warehouse {root} ({expected})") from error
    dataset = DATASETS.get(relative.parts[0]) if relative.parts else None
    if dataset is None or not part.is_file() or not Path(relative.name).match(PART_GLOB) \
            or len(relative.parts) != len(dataset.partition_keys) + 2:
        raise WarehouseError(f"{part}: not a part file of the warehouse {root} ({expected})")
    return dataset, Path(*relative.parts[1:-1])


def _foreign(root: Path, dataset: Dataset, path: Path, owner: Ownership) -> bool:
    manifest = Manifest(root, dataset, rehash=True, owner=owner)
    manifest.verify([path])  # a part whose bytes do not decode is named here, as by any read
    return bool(manifest.foreign)


def _check_foreign(root: Path, dataset: Dataset, part: Path, owner: Ownership) -> None:
    if not _foreign(root, dataset, part, owner):
        raise WarehouseError(f"{part}: a part this warehouse wrote; adopt and remove settle only parts it did "
                             "not write (`cleaner warehouse` lists them)")

