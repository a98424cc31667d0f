"""The warehouse: typed reads and writes of every dataset, and `connect()`, which verifies the parts
the SQL views (views.py) may read.

Layout (docs/architecture.md §3): `<root>/<dataset>/<key>=<value>/.../part-<uuid>.parquet`.

Commit protocol for collection and evaluation: a batch of complete rollouts is written as a segments
part and then a rollouts part with the SAME file name. The rollouts part is the commit marker: a
segments part whose twin is missing (the writer died in between) is invisible to every reader, so
`collect --resume` (or an evaluation run again) can regenerate those rollouts without duplicating a row.
Every read goes through `parts.visible_parts`, which also hides the parts a compaction has merged
(`compact.py`).

Purified rows are idempotent per rollout, not per config: a config's rows may come from several
parts (shards of one purify, docs/architecture.md §5), and a write skips the rollouts that already
have rows under their config. Shares are whole GRPO groups, so a group's rows are always written
together, in one part.

Every read hands on only verified parts: a `Manifest` reads each part in full once (its footer,
every page with its checksum, its CRC-32) and afterwards only stats it (docs/architecture.md §3).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cleaner.errors import existing_ancestor, read_only_file_system
from cleaner.records import (
    EvalRunRow,
    IterationRow,
    PurifiedRow,
    PurifyConfigRow,
    Rollout,
    Segment,
    TrainStepRow,
)
from cleaner.warehouse import schema
from cleaner.warehouse.compact import LOCK_NAME, compaction_paused, replace_parts
from cleaner.warehouse.configs import ConfigFiles
from cleaner.warehouse.lock import (
    LOCKS_DIR,
    missing_directories,
    phase_lock,
    purified_write_lock,
    remove_if_only_locks,
)
from cleaner.warehouse.manifest import MANIFEST_DIR, Manifest
from cleaner.warehouse.ownership import (
    IDENTITY_FILE,
    Ownership,
    claim,
    foreign_line,
    foreign_part,
    ownership,
)
from cleaner.warehouse.parts import (
    MERGED_PREFIX,
    PART_GLOB,
    PartExistsError,
    WarehouseError,
    new_part_name,
    read_column,
    read_part,
    read_parts,
    remove_leftovers,
    visible_parts,
    write_part,
)
from cleaner.warehouse.schema import COMMITTED_BY, DATASETS, Dataset
from cleaner.warehouse.views import open_views

logger = logging.getLogger(__name__)

__all__ = ["Warehouse", "WarehouseError"]

MIN_ID_PREFIX = 4  # digits of a config id that name it, as git's shortest abbreviation
# What a warehouse directory holds (one of them at least, unless it is empty and new)
WAREHOUSE_ENTRIES = frozenset({*DATASETS, "configs", MANIFEST_DIR, LOCKS_DIR, LOCK_NAME, IDENTITY_FILE})


class Warehouse(ConfigFiles):
    """A warehouse directory. Cheap to construct; nothing is read until asked. Its resolved
    configs and plans are JSON files (`ConfigFiles`).

    `read_only=True` opens it for readers that must leave the directory byte for byte as it was
    (`cleaner ui`): `connect()` keeps the validation manifest in memory instead of writing it, and
    every write raises WarehouseError.
    """

    def __init__(self, root: Path | str, read_only: bool = False) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self._checked: dict[str, dict] = {}  # read-only: each dataset's validated parts, in memory
        self._checked_writable = False
        self._owner: Ownership | None = None  # once it has an id, it keeps it

    def check_writable(self) -> None:
        """WarehouseError if opened read-only, or unless the root is a directory, or can be made
        one (nothing is created).

        Jobs call it before any work; every write checks it once, so a file given as the warehouse
        is one error line, never an OSError from deep inside a write."""
        if self.read_only:
            raise WarehouseError(f"{self.root}: opened read-only; nothing may be written")
        if self._checked_writable:
            return
        existing = existing_ancestor(self.root)
        if not existing.is_dir():
            where = "is a file, not a warehouse directory" if existing == self.root.absolute() else f"{existing} is a file"
            raise WarehouseError(f"{self.root}: {where}; a warehouse is a directory (created if missing)")
        if read_only_file_system(existing):
            raise WarehouseError(f"{self.root}: cannot write into {existing}: it is on a read-only file system "
                                 "(readers work there: sql, show, report, ui; write to a writable copy)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise WarehouseError(f"{self.root}: cannot write into {existing} (permission denied)")
        self._checked_writable = True

    def check_is_warehouse(self) -> None:
        """WarehouseError unless the root (an existing directory) is empty or holds what a
        warehouse holds: a reader pointed at a run directory, or at `/`, would answer 0 rows."""
        try:
            names = set(os.listdir(self.root))
        except OSError:
            return  # absent or unreadable: the read says so
        if not names or names & WAREHOUSE_ENTRIES:
            return
        inner = self.root / "warehouse"
        if inner.is_dir() and set(os.listdir(inner)) & WAREHOUSE_ENTRIES:
            raise WarehouseError(f"{self.root}: not a warehouse but a run directory: its warehouse is {inner} "
                                 f"(-w {inner})")
        raise WarehouseError(f"{self.root}: not a warehouse: it holds none of a warehouse's folders "
                             f"({', '.join(sorted(d + '/' for d in DATASETS)[:3])}, configs/, ...); give -w "
                             "the warehouse directory")

    @contextlib.contextmanager
    def writer(self, phase: str, iteration: int, share: tuple[int, int] | None = None) -> Iterator[None]:
        """Hold the lock a job holds while it writes `phase`'s rows of `iteration` (collect, purify,
        train), or of one shard (index, count) of it: a second writer gets LockHeld at once, naming
        the holder (lock.py). A job that fails before writing anything into a warehouse it created
        (a model that does not load) leaves no directory behind, lock files included."""
        self.check_writable()
        created = missing_directories(self.root)
        try:
            with phase_lock(self.root, phase, iteration, share):
                yield
        except BaseException:
            remove_if_only_locks(self.root, created)
            raise

    def _dir(self, dataset: Dataset, **partition: object) -> Path:
        path = self.root / dataset.name
        for key in dataset.partition_keys:
            path = path / f"{key}={partition[key]}"
        return path

    def _write(self, dataset: Dataset, rows: Sequence, name: str | None = None, **partition) -> Path:
        self.check_writable()
        table = schema.to_table(dataset, rows)
        return write_part(self._dir(dataset, **partition), table, name, stamp=self.stamp)

    def format_version(self) -> int:
        """The oldest format its data has (format.py)."""
        return self.ownership().format_version

    def ownership(self) -> Ownership:
        """What tells this warehouse's parts from others' (ownership.py)."""
        if self._owner is None or self._owner.warehouse_id is None:
            self._owner = ownership(self.root)
        return self._owner

    def stamp(self, path: Path) -> bytes:
        """The ownership stamp of a part this warehouse writes at `path` (its first write gives the
        warehouse its id)."""
        if self.ownership().warehouse_id is None:
            self._owner = claim(self.root)
        return self._owner.stamp(path)

    # -----------------------------------------------------------------------------------------
    # Collection

    def write_rollouts(self, iteration: int, rollouts: Sequence[Rollout], segments: Sequence[Segment]) -> None:
        """Commit one batch of complete rollouts (segments first; the rollouts part commits them)."""
        self._commit(schema.SEGMENTS, rollouts, segments, iteration=iteration)

    def _commit(self, segments_dataset: Dataset, rollouts: Sequence[Rollout], segments: Sequence[Segment],
                **partition) -> None:
        ids = {r.rollout_id for r in rollouts}
        stray = {s.rollout_id for s in segments} - ids
        if stray:
            raise ValueError(f"segments of rollouts not in this batch: {sorted(stray)[:3]}")
        name = new_part_name()
        twin = self._write(segments_dataset, segments, name, **partition)
        try:
            self._write(schema.COMMITTED_BY[segments_dataset.name], rollouts, name, **partition)
        except BaseException:  # the segments part would stay behind, uncommitted: remove it (a full disk
            with contextlib.suppress(OSError):  # frees a file; a SIGKILL here leaves it to the next writer)
                twin.unlink()
            raise

    def remove_uncommitted(self, iteration: int, owned: Callable[[str], bool] | None = None) -> int:
        """Delete the segments parts of `iteration` that no rollouts part commits (a collection killed
        between its two writes), those whose rollouts are all `owned` (all, when None): call it only
        holding the collect lock of what `owned` covers, since a writer between its two writes has
        such a part too. One the warehouse did not write stays (the readers name it). Returns how
        many went."""
        directory = self._dir(schema.SEGMENTS, iteration=iteration)
        committed = self._dir(schema.ROLLOUTS, iteration=iteration)
        removed = remove_leftovers(directory) + remove_leftovers(committed)
        owner = self.ownership()
        for part in sorted(directory.glob(PART_GLOB)) if directory.is_dir() else ():
            if part.name.startswith(MERGED_PREFIX) or (committed / part.name).exists():
                continue  # committed, or a compaction's (compact.py rolls those forward)
            if foreign_part(owner, part) is not None:
                continue  # not the warehouse's: the readers name it, `cleaner warehouse` settles it
            ids = set(pq.read_table(part, columns=["rollout_id"]).column("rollout_id").to_pylist())
            if owned is None or all(owned(rollout_id) for rollout_id in ids):
                part.unlink(missing_ok=True)
                removed += 1
        if removed:
            logger.info("removed %d uncommitted segments parts of iteration %d", removed, iteration)
        return removed

    def _visible(self, dataset: Dataset, **partition: object) -> list[Path]:
        """The visible parts of `dataset` in `partition` that the warehouse wrote, each verified
        (`Manifest.verify`); the others are left out (`parts_of` names them)."""
        return self.parts_of(dataset, **partition)[0]

    def parts_of(self, dataset: Dataset, **partition: object) -> tuple[list[Path], dict[Path, str]]:
        """The visible parts of `dataset` in `partition`, each verified: the warehouse's own, and
        the others with why they are not its own (ownership.py)."""
        marker = COMMITTED_BY.get(dataset.name)
        marker_parts = None
        if marker is not None:  # only the commit markers' names (and merged ones' lists) are needed
            marker_manifest = self._manifest(marker)
            marker_parts = visible_parts(self.root, marker, partition, marker_manifest.check)
            self._keep(marker_manifest)
        manifest = self._manifest(dataset)
        parts = visible_parts(self.root, dataset, partition, manifest.check, marker_parts=marker_parts)
        manifest.verify(parts)
        self._keep(manifest)
        return [p for p in parts if p not in manifest.foreign], {p: manifest.foreign[p] for p in parts
                                                                  if p in manifest.foreign}

    def _manifest(self, dataset: Dataset) -> Manifest:
        return Manifest(self.root, dataset, self._checked.get(dataset.name), owner=self.ownership())

    def _keep(self, manifest: Manifest) -> None:
        """Save a partial read's entries: merged into the file, or in memory when read-only."""
        if self.read_only:
            self._checked[manifest.dataset.name] = {**self._checked.get(manifest.dataset.name, {}), **manifest.checked}
        else:
            manifest.save()

    def read_rollouts(self, iteration: int) -> list[Rollout]:
        """An iteration's committed rollouts; an error if one is stored twice (two writers)."""
        table = read_parts(self._visible(schema.ROLLOUTS, iteration=iteration), schema.ROLLOUTS)
        if pc.count_distinct(table["rollout_id"]).as_py() < table.num_rows:
            counts = pc.value_counts(table["rollout_id"]).to_pylist()
            twice = sorted(c["values"] for c in counts if c["counts"] > 1)
            raise WarehouseError(
                f"{self.root}: iteration {iteration} stores {len(twice)} rollout(s) more than once "
                f"({', '.join(twice[:3])}{', ...' if len(twice) > 3 else ''}): two processes collected "
                "it at once; delete the iteration's rollouts and segments parts and collect it again")
        return schema.from_table(schema.ROLLOUTS, table)

    def read_segments(self, iteration: int, rollout_ids: Collection[str] | None = None) -> list[Segment]:
        """The committed segments of an iteration; of the given rollouts only, if given."""
        table = read_parts(self._visible(schema.SEGMENTS, iteration=iteration), schema.SEGMENTS)
        return schema.from_table(schema.SEGMENTS, _of_rollouts(table, rollout_ids))

    def rollout_ids(self, iteration: int) -> frozenset[str]:
        """Ids of the rollouts already committed for an iteration (for --resume)."""
        parts = self._visible(schema.ROLLOUTS, iteration=iteration)
        return frozenset(read_column(parts, schema.ROLLOUTS, "rollout_id").to_pylist())

    def iterations_collected(self) -> list[int]:
        parts = visible_parts(self.root, schema.ROLLOUTS)  # names only: no part is read
        return sorted({int(p.parent.name.split("=", 1)[1]) for p in parts})

    # -----------------------------------------------------------------------------------------
    # Purification

    def purified_rollout_ids(self, iteration: int, config_id: str) -> frozenset[str]:
        """The rollouts that already have rows under a config, from any shard (a purify skips them)."""
        parts = self._visible(schema.PURIFIED, iteration=iteration, config=config_id)
        return frozenset(read_column(parts, schema.PURIFIED, "rollout_id").to_pylist())

    def write_purified(self, iteration: int, config: PurifyConfigRow, rows: Sequence[PurifiedRow]) -> None:
        """Write one config's rows of an iteration, and its config row if new. Idempotent per rollout."""
        self.write_purified_many(iteration, [(config, rows)])

    def write_purified_many(
        self, iteration: int, results: Sequence[tuple[PurifyConfigRow, Sequence[PurifiedRow]]]
    ) -> None:
        """`write_purified` for several configs: their new config rows go in one part, first.

        A rollout never has two rows under one config (or two of one negative sample), however
        the writes meet: a config given twice is written once, a rollout that has rows already
        under a config gets none, and the check and the write hold the iteration's write lock of
        purified rows (`lock.purified_write_lock`), so two processes (shards of two shard counts,
        a resumed purify beside another) cannot both find a rollout missing and both store it."""
        self.check_writable()
        with purified_write_lock(self.root, iteration):
            todo: dict[str, tuple[PurifyConfigRow, list[PurifiedRow]]] = {}
            for config, rows in results:
                stored = self.purified_rollout_ids(iteration, config.config_id)
                config, kept = todo.setdefault(config.config_id, (config, []))
                taken = stored | {row.rollout_id for row in kept}
                seen = set()
                for row in rows:
                    key = (row.rollout_id, row.negative_seq)
                    if row.rollout_id not in taken and key not in seen:
                        seen.add(key)
                        kept.append(row)
            todo = {config_id: pair for config_id, pair in todo.items() if pair[1]}
            self._write_config_rows([config for config, _ in todo.values()])
            # one conversion for all configs, so rows they share are converted once (schema._column)
            table = schema.to_table(schema.PURIFIED, [row for _, rows in todo.values() for row in rows])
            offset = 0
            for config, rows in todo.values():
                part = table.slice(offset, len(rows))
                offset += len(rows)
                write_part(self._dir(schema.PURIFIED, iteration=iteration, config=config.config_id), part,
                           stamp=self.stamp)

    def _write_config_rows(self, configs: Sequence[PurifyConfigRow]) -> None:
        known = self.purify_config_ids() if configs else set()
        new = list({c.config_id: c for c in configs if c.config_id not in known}.values())
        if not new:
            return
        # Shards purifying the same configs at once give the part the same name, so it is written
        # once (a rename onto an existing name replaces it with identical rows).
        digest = hashlib.sha256(",".join(sorted(c.config_id for c in new)).encode()).hexdigest()[:32]
        with contextlib.suppress(PartExistsError):
            self._write(schema.PURIFY_CONFIGS, new, f"part-{digest}.parquet")

    def purify_config_ids(self) -> set[str]:
        return set(read_column(self._visible(schema.PURIFY_CONFIGS), schema.PURIFY_CONFIGS, "config_id").to_pylist())

    def purify_params(self, config_id: str) -> str | None:
        """The stored purify config's parameters as JSON (`params_json`); None if it is not stored."""
        table = read_parts(self._visible(schema.PURIFY_CONFIGS), schema.PURIFY_CONFIGS)
        rows = [row for row in schema.from_table(schema.PURIFY_CONFIGS, table) if row.config_id == config_id]
        return rows[0].params_json if rows else None

    def resolve_config_id(self, prefix: str) -> str:
        """The stored purify config id that `prefix` begins, as git resolves a short commit id (the
        tables print 8 of its 12 digits). WarehouseError if several do, or if it is shorter than
        MIN_ID_PREFIX; `prefix` itself if none does (the caller says what is missing)."""
        if len(prefix) < MIN_ID_PREFIX:
            raise WarehouseError(f"config id {prefix!r}: give at least {MIN_ID_PREFIX} of its digits")
        ids = self.purify_config_ids()
        if prefix in ids:
            return prefix
        matches = sorted(config_id for config_id in ids if config_id.startswith(prefix))
        if len(matches) > 1:
            raise WarehouseError(f"{self.root}: config id {prefix!r} is ambiguous, it begins "
                                 f"{', '.join(matches)}; give more digits")
        return matches[0] if matches else prefix

    def read_purified(self, iteration: int, config_id: str,
                      rollout_ids: Collection[str] | None = None) -> list[PurifiedRow]:
        """A config's rows of an iteration; of the given rollouts only, if given."""
        parts = self._visible(schema.PURIFIED, iteration=iteration, config=config_id)
        if not parts:
            raise WarehouseError(
                f"{self.root}: no purified rows for iteration {iteration} and config {config_id}"
            )
        table = _of_rollouts(read_parts(parts, schema.PURIFIED), rollout_ids)
        return schema.from_table(schema.PURIFIED, table)

    # -----------------------------------------------------------------------------------------
    # Training and the iteration log

    def write_train_steps(self, iteration: int, steps: Sequence[TrainStepRow]) -> None:
        """Write an iteration's optimiser steps, replacing the rows of an earlier training of the
        same purify config into the same checkpoint (a rerun): one part holding the new rows and
        the others of the parts it replaces, by compaction's protocol (compact.replace_parts)."""
        if not steps:
            return
        runs = {(step.config_id, step.checkpoint) for step in steps if step.config_id is not None}
        if not runs or not self._train_steps_of(iteration, runs):
            self._write(schema.TRAIN_STEPS, steps, iteration=iteration)
            return
        self.check_writable()
        with compaction_paused(self.root):  # listed again under the lock: no compaction merges them meanwhile
            earlier = self._train_steps_of(iteration, runs)
            kept = [table.filter(pc.invert(_of_runs(table, runs))) for table in earlier.values()]
            replace_parts(schema.TRAIN_STEPS, list(earlier), [*kept, schema.to_table(schema.TRAIN_STEPS, steps)],
                          self.stamp)

    def _train_steps_of(self, iteration: int, runs: set[tuple[str | None, str | None]]) -> dict[Path, pa.Table]:
        """The visible train_steps parts of `iteration` holding rows of `runs` (config id,
        checkpoint), each with its table."""
        tables = {part: read_part(part, schema.TRAIN_STEPS)
                  for part in self._visible(schema.TRAIN_STEPS, iteration=iteration)}
        return {part: table for part, table in tables.items() if pc.any(_of_runs(table, runs)).as_py()}

    def read_train_steps(self, iteration: int) -> list[TrainStepRow]:
        """An iteration's optimiser steps in order."""
        table = read_parts(self._visible(schema.TRAIN_STEPS, iteration=iteration), schema.TRAIN_STEPS)
        return sorted(schema.from_table(schema.TRAIN_STEPS, table), key=lambda row: row.optimizer_step)

    def has_train_steps(self, iteration: int) -> bool:
        return bool(visible_parts(self.root, schema.TRAIN_STEPS, {"iteration": iteration}))  # names only

    def write_iteration(self, row: IterationRow) -> None:
        self._write(schema.ITERATIONS, [row])

    def read_iterations(self) -> list[IterationRow]:
        table = read_parts(self._visible(schema.ITERATIONS), schema.ITERATIONS)
        return sorted(schema.from_table(schema.ITERATIONS, table), key=lambda row: row.iteration)

    # -----------------------------------------------------------------------------------------
    # Evaluation: rollouts and segments per eval id, one eval_runs row per completed evaluation

    def write_eval_batch(self, eval_id: str, rollouts: Sequence[Rollout], segments: Sequence[Segment]) -> None:
        """Commit one batch of an evaluation's rollouts, with the collection's protocol."""
        self._commit(schema.EVAL_SEGMENTS, rollouts, segments, eval=eval_id)

    def read_eval_rollouts(self, eval_id: str) -> list[Rollout]:
        table = read_parts(self._visible(schema.EVAL_ROLLOUTS, eval=eval_id), schema.EVAL_ROLLOUTS)
        return schema.from_table(schema.EVAL_ROLLOUTS, table)

    def read_eval_segments(self, eval_id: str) -> list[Segment]:
        table = read_parts(self._visible(schema.EVAL_SEGMENTS, eval=eval_id), schema.EVAL_SEGMENTS)
        return schema.from_table(schema.EVAL_SEGMENTS, table)

    def eval_rollout_ids(self, eval_id: str) -> frozenset[str]:
        """Ids of an evaluation's committed rollouts (an interrupted evaluation skips them)."""
        return frozenset(rollout.rollout_id for rollout in self.read_eval_rollouts(eval_id))

    def write_eval_run(self, row: EvalRunRow) -> None:
        self._write(schema.EVAL_RUNS, [row])

    def read_eval_run(self, eval_id: str) -> EvalRunRow | None:
        """The completed evaluation `eval_id`, or None if it has not completed."""
        table = read_parts(self._visible(schema.EVAL_RUNS), schema.EVAL_RUNS)
        rows = [row for row in schema.from_table(schema.EVAL_RUNS, table) if row.eval_id == eval_id]
        return rows[0] if rows else None

    # -----------------------------------------------------------------------------------------
    # One rollout, for `cleaner show`

    def read_rollout(self, rollout_id: str, connection: duckdb.DuckDBPyConnection | None = None,
                     ) -> tuple[Rollout | None, list[Segment]]:
        """One rollout and its committed segments in seq order, collected or evaluated (None, [] if
        unknown); over `connection` (one of `connect()`'s) if given, else a new one."""
        connection = connection or self.connect()
        for rollouts_dataset, segments_dataset in ((schema.ROLLOUTS, schema.SEGMENTS),
                                                   (schema.EVAL_ROLLOUTS, schema.EVAL_SEGMENTS)):
            rollouts = schema.from_table(rollouts_dataset, connection.sql(
                f"SELECT * FROM {rollouts_dataset.name} WHERE rollout_id = ?", params=[rollout_id]).to_arrow_table())
            segments = schema.from_table(segments_dataset, connection.sql(
                f"SELECT * FROM {segments_dataset.name} WHERE rollout_id = ? ORDER BY seq",
                params=[rollout_id]).to_arrow_table())
            if rollouts or segments:
                return (rollouts[0] if rollouts else None), segments
        return None, []

    def read_purified_of(self, rollout_id: str, iteration: int,
                         connection: duckdb.DuckDBPyConnection | None = None,
                         ) -> list[tuple[PurifiedRow, PurifyConfigRow | None]]:
        """The rollout's purified row under every stored config of its iteration, with the config's
        row (None if missing), ordered by the config's parameters; over `connection` if given."""
        connection = connection or self.connect()
        rows = schema.from_table(schema.PURIFIED, connection.sql(
            "SELECT * FROM purified WHERE rollout_id = ? AND iteration = ?",
            params=[rollout_id, iteration]).to_arrow_table())
        configs = {c.config_id: c for c in schema.from_table(schema.PURIFY_CONFIGS, connection.sql(
            "SELECT * FROM purify_configs").to_arrow_table())}
        pairs = [(row, configs.get(row.config_id)) for row in rows]
        return sorted(pairs, key=lambda pair: (pair[1] is None, _config_order(pair[1]), pair[0].config_id))

    # -----------------------------------------------------------------------------------------
    # SQL

    def connect(self, verify_content: bool = False, settings: dict[str, object] | None = None, *,
                warn_foreign: bool = True) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB connection with one view per dataset plus convenience views.

        Every visible part is verified first (`Manifest.verify`): read in full if it is new or its
        identity on the file system changed, else trusted from the manifest; `verify_content` also
        compares the CRC-32 of every part's bytes with the manifest's, reading the whole warehouse.
        DuckDB checks no page checksum, so this is where the SQL path's parts are checked (docs/
        architecture.md §3, "Checksums"). A bad file raises WarehouseError naming it, and nothing but
        the manifest (a cache) is ever written, and only when every part passed; a read-only
        warehouse keeps it in memory and writes nothing. Datasets with no parts yet get an empty view
        with the right columns. `settings` are DuckDB's, given when the database is opened
        (`cleaner ui`'s temp directory, memory and threads). `views.cursor_of` gives another thread its
        own connection to the same views. A part the warehouse did not write (ownership.py) is left
        out of the views, with a warning naming it unless `warn_foreign` is off (a reader that
        says the gate's findings itself, warehouse/gate.py).
        """
        if not self.root.is_dir():
            raise WarehouseError(f"{self.root}: no such warehouse directory")
        self.check_is_warehouse()
        owner = self.ownership()
        manifests = {name: Manifest(self.root, dataset, self._checked.get(name), rehash=verify_content, owner=owner)
                     for name, dataset in DATASETS.items()}
        listed: dict[str, list[Path]] = {}
        visible: dict[str, list[Path]] = {}
        for dataset in sorted(DATASETS.values(), key=lambda d: d.name in COMMITTED_BY):  # markers first
            manifest = manifests[dataset.name]
            marker = COMMITTED_BY.get(dataset.name)
            parts = visible_parts(self.root, dataset, replaces_of=manifest.check,
                                  marker_parts=None if marker is None else listed[marker.name])
            manifest.verify(parts)
            listed[dataset.name] = parts
            visible[dataset.name] = [part for part in parts if part not in manifest.foreign]
            for part, reason in manifest.foreign.items() if warn_foreign else ():
                logger.warning("%s", foreign_line(self.root, part, reason))
        for name, manifest in manifests.items():
            if self.read_only:
                self._checked[name] = manifest.checked
            else:
                manifest.save(complete=True)
        return open_views(visible, settings)


def _of_rollouts(table: pa.Table, rollout_ids: Collection[str] | None) -> pa.Table:
    """The rows of `table` whose rollout_id is in `rollout_ids` (all rows if None), filtered in Arrow
    so the rows of other shards are never turned into Python records."""
    if rollout_ids is None:
        return table
    return table.filter(pc.is_in(table.column("rollout_id"), value_set=pa.array(sorted(rollout_ids), pa.string())))


def _of_runs(table: pa.Table, runs: set[tuple[str | None, str | None]]) -> pa.ChunkedArray:
    """Which rows of a train_steps table belong to one of `runs` (config id, checkpoint)."""
    keys = pc.binary_join_element_wise(pc.fill_null(table["config_id"], ""), pc.fill_null(table["checkpoint"], ""),
                                       "\n")
    return pc.is_in(keys, value_set=pa.array(sorted(f"{config}\n{checkpoint}" for config, checkpoint in runs)))


def _config_order(config: PurifyConfigRow | None) -> tuple:
    if config is None:
        return ()
    return (config.gamma, config.rollback_prob, config.similarity_on, config.purify_when)
