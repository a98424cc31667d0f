"""`cleaner compact`: merge each partition's small parts into few, atomically (docs/architecture.md §3).

One merge of parts P1..Pk of a partition into M:
1. M is written as `part-merged-<uuid>.parquet` under a hidden temporary name, fsynced, and renamed
   into place; its footer lists P1..Pk (`parts.REPLACES_KEY`). From that rename on, every reader
   hides P1..Pk (`parts.visible_parts`): the rows are seen once, in M.
2. P1..Pk are removed.
("Renamed" here is the atomic step that gives a part its name: a hard link refused if the name
exists, parts.py.)
A crash before the rename leaves a hidden temporary file and changes nothing readers see; a crash
after it leaves replaced parts no reader sees, which the next compaction removes ("rolls forward")
before it plans anything. No row is ever visible twice or not at all.

Collection partitions merge a rollouts part together with its segments twin. The merged segments
part is renamed first; it is invisible (it has no rollouts twin yet). The merged rollouts part of the
same name is renamed second, and that rename is the single commit point: it hides the replaced
rollouts parts, which makes their segments invisible (their twins are hidden), and it commits the
merged segments. A crash between the two renames leaves a merged segments part without a twin,
invisible like any uncommitted segments part, which the next compaction removes. Uncommitted
segments parts of a crashed collection have no twin, so they are never merged and stay invisible.

Design decisions:
- Small parts: a part (a collection part: with its twin) below `target_bytes` is a candidate;
  candidates are packed in name order into bins of at most `target_bytes`, and each bin of two or
  more becomes one merged part, which is itself a candidate next time while it is small. Rows keep
  their order within each part; parts follow each other in name order.
- One compaction at a time: an exclusive `flock` on `<warehouse>/.compact.lock` (lock.py), which the
  kernel releases if the process dies, so a crash never leaves it held; a refused compaction names
  the holder. Writers need no lock: they only add
  parts, and a compaction merges only the parts it listed. Readers need none for crash safety, but a
  reader that listed parts just before a compaction removed some may fail to open one and must read
  again.
- Every input part is verified before it is read (`Manifest.verify`, comparing every part's CRC-32
  with the manifest's), so a corrupt part stops the compaction with the usual error naming it,
  before anything it would replace is removed, and a flipped byte is never rewritten into a merged
  part under fresh page checksums. Merged parts are written with page checksums, so compacting a
  warehouse written before cleaner wrote them gives its small parts checksums too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from cleaner.errors import read_only_file_system
from cleaner.warehouse.lock import LockHeld, exclusive, phase_lock_path
from cleaner.warehouse.manifest import Manifest
from cleaner.warehouse.ownership import Ownership, claim, foreign_line, foreign_part
from cleaner.warehouse.parts import (
    MERGED_PREFIX,
    PART_GLOB,
    WarehouseError,
    fsync_dir,
    list_parts,
    new_merged_name,
    read_part,
    remove_leftovers,
    stamp_of,
    validate_part,
    write_merged,
)
from cleaner.warehouse.schema import COMMITTED_BY, DATASETS, Dataset

logger = logging.getLogger(__name__)

DEFAULT_TARGET_BYTES = 128 * 2**20
LOCK_NAME = ".compact.lock"


@dataclass(frozen=True)
class Merge:
    """Parts of one dataset's partition merged into one part."""

    dataset: str
    partition: str  # e.g. "iteration=3", "" for an unpartitioned dataset
    n_parts: int  # parts replaced
    n_rows: int
    bytes_before: int
    bytes_after: int
    part: str = ""  # the merged part's file name


@dataclass(frozen=True)
class CompactResult:
    merges: tuple[Merge, ...]
    n_leftovers: int  # files of an interrupted compaction removed (replaced parts, orphans)


@dataclass(frozen=True)
class Partition:
    """One partition directory of a dataset and, for a commit-marker dataset, its twins'."""

    dataset: Dataset
    relative: Path  # under the dataset's directory
    twins: tuple[Dataset, ...]  # datasets committed by this one (segments for rollouts)

    def directory(self, root: Path, dataset: Dataset | None = None) -> Path:
        return root / (dataset or self.dataset).name / self.relative


def compact(root: Path, dataset: str | None = None, iteration: int | None = None,
            target_bytes: int = DEFAULT_TARGET_BYTES) -> CompactResult:
    """Merge the small parts of every chosen partition; roll forward any interrupted compaction."""
    if not root.is_dir():
        raise WarehouseError(f"{root}: no such warehouse directory")
    if read_only_file_system(root):
        raise WarehouseError(f"{root}: cannot compact it: it is on a read-only file system (readers work there: sql, show, report, ui)")
    if target_bytes <= 0:
        raise WarehouseError(f"the target part size must be > 0 bytes, got {target_bytes}")
    merges: list[Merge] = []
    leftovers = 0
    with exclusive(root / LOCK_NAME, f"{root}: another `cleaner compact` is running", "wait for it to end"):
        owner = claim(root)
        for partition in _partitions(root, _chosen(dataset, iteration), iteration):
            leftovers += sum(remove_leftovers(partition.directory(root, twin))
                             for twin in (None, *partition.twins))  # killed writers' temporaries
            leftovers += _roll_forward(root, partition, owner)
            leftovers += _remove_uncommitted(root, partition, owner)
            for names in _plan(root, partition, target_bytes):
                merges += merge_parts(root, partition, names, owner)
    return CompactResult(tuple(merges), leftovers)


def _chosen(name: str | None, iteration: int | None) -> list[Dataset]:
    """The commit-marker datasets to compact; a committed dataset goes with its marker."""
    if name is not None and name not in DATASETS:
        raise WarehouseError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    datasets = [DATASETS[name]] if name is not None else list(DATASETS.values())
    if name is not None and iteration is not None and "iteration" not in DATASETS[name].partition_keys:
        raise WarehouseError(f"{name} is not partitioned by iteration; compact it without --iteration")
    markers = [COMMITTED_BY.get(d.name, d) for d in datasets]
    return [d for d in dict.fromkeys(markers) if iteration is None or "iteration" in d.partition_keys]


def _partitions(root: Path, datasets: Sequence[Dataset], iteration: int | None) -> list[Partition]:
    selected = {} if iteration is None else {"iteration": iteration}
    found = []
    for dataset in datasets:
        twins = tuple(DATASETS[name] for name, marker in COMMITTED_BY.items() if marker is dataset)
        base = root / dataset.name
        for relative in sorted({p.parent.relative_to(base) for p in list_parts(root, dataset, selected)}):
            found.append(Partition(dataset, relative, twins))
    return found


@contextlib.contextmanager
def compaction_paused(root: Path) -> Iterator[None]:
    """Hold the compaction lock for the block, waiting for a running compaction to end: a writer
    that replaces parts (`replace_parts`) must not race one that merges them."""
    with exclusive(root / LOCK_NAME, f"{root}: `cleaner compact` is running", "", wait=True):
        yield


def replace_parts(dataset: Dataset, replaced: Sequence[Path], tables: Sequence[pa.Table],
                  stamp: Callable[[Path], bytes]) -> Path:
    """Write `tables` as one part replacing the parts `replaced` of one partition directory, by a
    merge's protocol: the new part lists them in its footer, so its rename hides them, then they
    are removed. The caller holds `compaction_paused` and read `replaced` under it; `stamp` is the
    warehouse's (ownership.py)."""
    directory = replaced[0].parent
    path = write_merged(directory, new_merged_name(), tables, dataset, [p.name for p in replaced], stamp)
    for part in replaced:
        _remove(part)
    fsync_dir(directory)
    return path


# ---------------------------------------------------------------------------------------------
# Rolling an interrupted compaction forward


def _roll_forward(root: Path, partition: Partition, owner: Ownership) -> int:
    """Remove what an interrupted compaction left: replaced parts, uncommitted merged twins and
    temporary files. Returns how many files were removed. A merged part the warehouse did not
    write (ownership.py) removes nothing: the readers name it."""
    removed = 0
    directory = partition.directory(root)
    for dataset in (partition.dataset, *partition.twins):
        here = partition.directory(root, dataset)
        before = removed
        for stale in here.glob(f".{MERGED_PREFIX}*.tmp"):  # no compaction but this one is running
            removed += _remove(stale)
        for merged in sorted(here.glob(f"{MERGED_PREFIX}*.parquet")):
            if not merged.exists():
                continue  # itself merged again, and removed by a part listed before it
            if owner.foreign_reason(merged, stamp_of(merged)) is not None:
                continue
            if dataset is not partition.dataset and not (directory / merged.name).exists():
                removed += _remove(merged)  # renamed before its commit marker: never visible
                continue
            removed += sum(_remove(here / name) for name in validate_part(merged, dataset))
        if removed > before:
            fsync_dir(here)
    if removed:
        logger.info("removed %d files of an interrupted compaction in %s", removed, directory)
    return removed


def _remove_uncommitted(root: Path, partition: Partition, owner: Ownership) -> int:
    """Remove the twins no commit marker commits in a collection's partition (a collection killed
    between its two writes), holding the iteration's collect lock; while a collection runs there
    (it holds the lock), its part between its two writes is such a twin, so nothing is removed. A
    twin the warehouse did not write stays: the readers name it (ownership.py)."""
    iteration = _iteration_of(partition)
    if iteration is None or not partition.twins:
        return 0  # an evaluation's partition: eval takes no lock, so its twins are left alone
    try:
        with exclusive(phase_lock_path(root, "collect", iteration), "", ""):
            removed = 0
            for dataset in partition.twins:
                for part in sorted(partition.directory(root, dataset).glob(PART_GLOB)):
                    if not part.name.startswith(MERGED_PREFIX) and not (partition.directory(root) / part.name).exists() \
                            and foreign_part(owner, part) is None:  # a foreign one is the user's to settle
                        removed += _remove(part)
    except LockHeld:
        return 0
    if removed:
        logger.info("removed %d uncommitted parts of iteration %d", removed, iteration)
    return removed


def _iteration_of(partition: Partition) -> int | None:
    """The iteration of a collection's partition (`iteration=<i>`), else None."""
    name = partition.relative.name
    return int(name.split("=", 1)[1]) if partition.dataset.name == "rollouts" and name.startswith("iteration=") else None


def _remove(path: Path) -> int:
    try:
        path.unlink()
    except FileNotFoundError:
        return 0
    return 1


# ---------------------------------------------------------------------------------------------
# Planning and merging


def _plan(root: Path, partition: Partition, target_bytes: int) -> list[list[str]]:
    """Bins of part names to merge, each of two or more small parts (module docstring)."""
    bins: list[list[str]] = [[]]
    size = 0
    for path in sorted(partition.directory(root).glob(PART_GLOB)):
        unit = sum(_size(partition.directory(root, d) / path.name)
                   for d in (partition.dataset, *partition.twins))
        if unit >= target_bytes:
            continue
        if bins[-1] and size + unit > target_bytes:
            bins.append([])
            size = 0
        bins[-1].append(path.name)
        size += unit
    return [names for names in bins if len(names) >= 2]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def merge_parts(root: Path, partition: Partition, names: list[str], owner: Ownership, *,
                adopting: bool = False) -> list[Merge]:
    """Merge the named parts: twins first, the commit marker last, then remove the originals.
    Every one is verified first, and one the warehouse did not write stops the merge before
    anything is written (its rows would become the warehouse's), unless `adopting` them."""
    present = {dataset: [partition.directory(root, dataset) / name for name in names
                         if (partition.directory(root, dataset) / name).exists()]
               for dataset in (partition.dataset, *partition.twins)}  # the marker named first, as readers do
    for dataset, paths in present.items():
        manifest = Manifest(root, dataset, rehash=True, owner=owner)
        manifest.verify(paths)
        if manifest.foreign and not adopting:
            path, reason = next(iter(manifest.foreign.items()))
            raise WarehouseError(f"cannot compact {foreign_line(root, path, reason)}")
    merged = new_merged_name()
    merges = [_write(partition, dataset, present[dataset], merged, owner) for dataset in (*partition.twins, partition.dataset)]
    for dataset in (partition.dataset, *partition.twins):  # the marker's last write above: the commit point
        directory = partition.directory(root, dataset)
        for name in names:
            _remove(directory / name)
        fsync_dir(directory)
    return [merge for merge in merges if merge is not None]


def _write(partition: Partition, dataset: Dataset, present: list[Path], merged: str,
           owner: Ownership) -> Merge | None:
    if not present:
        return None
    rows = 0

    def tables() -> Iterator[pa.Table]:
        nonlocal rows
        for path in present:
            table = read_part(path, dataset)
            rows += table.num_rows
            yield table

    path = write_merged(present[0].parent, merged, tables(), dataset, [p.name for p in present], owner.stamp)
    return Merge(dataset.name, str(partition.relative) if str(partition.relative) != "." else "",
                 len(present), rows, sum(p.stat().st_size for p in present), path.stat().st_size, path.name)
