"""The trajectory browser's reads (`cleaner ui`, docs/architecture.md §14): a rollout index, the
paged and filtered rollout list, one rollout read from its own part.

Design decisions:
- One `Browser` is a snapshot: one `connect()` of a read-only `Warehouse` (the manifest stays in
  memory, nothing is written), then an index, then the connection is locked down
  (`readonly.lock_down`). `refresh()` takes a new snapshot; until then new parts are not seen.
- A snapshot outlives what it read: after a `cleaner compact` its parts are gone, and the
  warehouse may be moved or deleted. A read that meets a missing file says which in one line
  (`SnapshotStale`: refresh; `WarehouseGone`: the directory itself), never a DuckDB error, and a
  refresh that cannot take a new snapshot says why and keeps the old one.
- The index (`rollout_index`, an in-memory DuckDB table, also visible to the SQL box) holds one
  small row per collected rollout: the list's columns, its premise class and error types (from its
  segments, computed once), and the path of its rollouts part. Filtering on an error type or a
  class then never scans `segments`, and a page is a LIMIT/OFFSET over an in-memory table: on a
  warehouse of thousands of parts each query over the views opens every part, the index does not.
- One rollout's segments are read from its rollouts part's twin (the commit protocol gives a
  segments part the name of the rollouts part that commits it, merged parts included), so showing
  it opens two files, not every segments part. Evaluation rollouts are not indexed; they are read
  through the views (`Warehouse.read_rollout`).
- The premise class is the one of `cleaner.engine.saar.premise.classify`, in SQL: clean without a failed
  call; recovered when every step with a failure ended in a successful call; else unrecovered. An
  error type is the exception's name, else the call's status, as in the report.
- The gate's findings (warehouse/gate.py: a part the warehouse did not write, an iteration being
  collected or incomplete, ...) are taken with each snapshot; every page says them, since a
  display shows what is stored instead of refusing it.
- The `Browser` reads what `cleaner.report.show.load_inspection` asks of a warehouse (`read_rollout`,
  `read_purified_of`, `collect_config`, `eval_config`), over its own connection.
"""

from __future__ import annotations

import contextlib
import queue
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import duckdb
import pyarrow as pa

from cleaner.records import PurifiedRow, PurifyConfigRow, Rollout, Segment
from cleaner.warehouse import readonly, schema
from cleaner.warehouse.gate import every_finding
from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.store import Warehouse
from cleaner.warehouse.views import cursor_of, parts_variable

INDEX = "rollout_index"
POOL_SIZE = 4  # cursors of the pages' database: reads that run at once
CLASSES = ("clean", "recovered", "unrecovered")

_INDEX_SQL = """
CREATE TABLE rollout_index AS
WITH steps AS (
    SELECT rollout_id, step, bool_or(tool_status <> 'ok') AS failed,
           arg_max(tool_status = 'ok', attempt) AS last_ok,
           list(DISTINCT coalesce(error_type, tool_status)) FILTER (WHERE tool_status <> 'ok') AS errors
    FROM segments WHERE kind = 'tool' GROUP BY rollout_id, step),
per_rollout AS (
    SELECT rollout_id,
           CASE WHEN NOT bool_or(failed) THEN 'clean'
                WHEN bool_and(last_ok OR NOT failed) THEN 'recovered' ELSE 'unrecovered' END AS premise_class,
           list_sort(list_distinct(flatten(list(errors) FILTER (WHERE errors IS NOT NULL)))) AS error_types
    FROM steps GROUP BY rollout_id)
SELECT r.rollout_id, r.iteration, r.group_id, r.sample_index, r.reward, r.correct, r.finish_reason,
       r.collect_view, r.n_tool_calls, r.n_failed_calls,
       coalesce(p.premise_class, 'clean') AS premise_class,
       coalesce(p.error_types, []::VARCHAR[]) AS error_types, r.part
FROM ({rollouts}) r LEFT JOIN per_rollout p USING (rollout_id)
"""


class SnapshotStale(WarehouseError):
    """A file the snapshot reads is gone: the warehouse changed since (a compaction); refresh."""


class WarehouseGone(SnapshotStale):
    """The warehouse directory itself is gone (moved or deleted) since the snapshot."""


def _stale(root: Path, error: Exception, doing: str = "a part the browser's snapshot reads is gone") -> SnapshotStale:
    """What a read that met a missing file (`error`) says: the warehouse is gone, or it changed."""
    if not root.is_dir():
        return WarehouseGone(f"{root}: the warehouse is gone (moved or deleted) since the browser read it; "
                             "start cleaner ui -w where it is now")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SnapshotStale(f"{doing} ({first}): the warehouse changed since the browser's snapshot (cleaner compact "
                         "merges parts); refresh to read it as it is now")


@dataclass(frozen=True)
class RolloutFilter:
    """Which rollouts the list shows; None = any."""

    iteration: int | None = None
    group_id: str | None = None
    reward_min: float | None = None  # reward >= this
    reward_max: float | None = None  # reward <= this
    finish_reason: str | None = None
    error_type: str | None = None  # has a failed call of this type (exception name, else status)
    premise_class: str | None = None  # clean | recovered | unrecovered
    collect_view: str | None = None

    def __post_init__(self) -> None:
        if self.premise_class is not None and self.premise_class not in CLASSES:
            raise ValueError(f"class must be one of {', '.join(CLASSES)}, got {self.premise_class!r}")

    def where(self) -> tuple[str, list]:
        """The SQL condition over `rollout_index` and its parameters."""
        conditions, params = ["TRUE"], []
        for column in ("iteration", "group_id", "finish_reason", "premise_class", "collect_view"):
            value = getattr(self, column)
            if value is not None:
                conditions.append(f"{column} = ?")
                params.append(value)
        if self.reward_min is not None:
            conditions.append("reward >= ?")
            params.append(self.reward_min)
        if self.reward_max is not None:
            conditions.append("reward <= ?")
            params.append(self.reward_max)
        if self.error_type is not None:
            conditions.append("list_contains(error_types, ?)")
            params.append(self.error_type)
        return " AND ".join(conditions), params


@dataclass(frozen=True)
class ListedRollout:
    """One row of the rollout list."""

    rollout_id: str
    iteration: int
    group_id: str
    sample_index: int
    reward: float
    correct: bool
    finish_reason: str
    collect_view: str
    n_tool_calls: int
    n_failed_calls: int
    premise_class: str
    error_types: tuple[str, ...]


_LISTED = ", ".join(f.name for f in fields(ListedRollout))
_ORDER = "ORDER BY iteration, group_id, sample_index, rollout_id"


@dataclass(frozen=True)
class RolloutPage:
    rows: tuple[ListedRollout, ...]
    total: int  # rollouts matching the filter
    offset: int
    limit: int


@dataclass(frozen=True)
class Facets:
    """The values each filter can take in this snapshot."""

    iterations: tuple[int, ...]
    finish_reasons: tuple[str, ...]
    error_types: tuple[str, ...]
    collect_views: tuple[str, ...]


def _listed(row: tuple) -> ListedRollout:
    values = list(row)
    values[-1] = tuple(values[-1])
    return ListedRollout(*values)


class Browser:
    """A read-only, locked-down snapshot of a warehouse (module docstring), safe to use from many
    threads: every read takes a cursor of its own from a small pool, and the SQL box (`sql`) has a
    database of its own, so no page ever waits for a query typed into it."""

    def __init__(self, warehouse: Warehouse, limits: readonly.SqlLimits | None = None,
                 pool_size: int = POOL_SIZE) -> None:
        if not warehouse.read_only:
            raise ValueError("the browser reads a Warehouse opened with read_only=True")
        self.warehouse = warehouse
        self.limits, self.pool_size = limits or readonly.SqlLimits(), pool_size
        self._swap = threading.Lock()  # held only to replace the snapshot
        self._pages, self.sql, self.findings = self._open()

    @property
    def root(self) -> Path:
        return self.warehouse.root

    def _open(self) -> tuple[_Pages, readonly.SqlBox, tuple[str, ...]]:
        """A snapshot: the pages' database, the SQL box's, and what the readers' gate finds in it
        (a display says it on every page instead of refusing)."""
        findings = tuple(every_finding(self.warehouse))
        pages = _Pages(self.warehouse, self.pool_size)
        index = pages.index()
        box = readonly.SqlBox(self.warehouse.connect(settings=readonly.sql_settings(self.limits), warn_foreign=False),
                              self.root, self.limits, tables={INDEX: index})
        return pages, box, findings

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection to the snapshot's views and index for this thread, returned to the pool
        after the block."""
        with self._swap:  # a snapshot being replaced is not closed while this read needs it
            pages = self._pages
            pages.reserve()
        with pages.cursor() as cursor:
            try:
                yield cursor
            except duckdb.IOException as error:  # a part removed since the snapshot
                raise _stale(self.root, error) from error

    def close(self) -> None:
        with self._swap:
            self.sql.close()
            self._pages.retire()

    def refresh(self) -> None:
        """A new snapshot: parts written since the last one become visible. Reads in flight finish
        on the old one; a query running in the old SQL box is interrupted. One that cannot be taken
        (the warehouse gone, a compaction removing parts as they are listed) raises a
        WarehouseError, and the old snapshot stays."""
        try:
            pages, box, findings = self._open()
        except WarehouseError as error:
            if not self.root.is_dir():
                raise _stale(self.root, error) from error
            raise
        except (OSError, duckdb.Error) as error:
            raise _stale(self.root, error, "no new snapshot could be taken") from error
        with self._swap:
            old_pages, old_box = self._pages, self.sql
            self._pages, self.sql, self.findings = pages, box, findings
        old_box.close()
        old_pages.retire()

    # -----------------------------------------------------------------------------------------
    # The list

    def list_rollouts(self, where: RolloutFilter, offset: int = 0, limit: int = 50) -> RolloutPage:
        condition, params = where.where()
        with self.cursor() as connection:
            rows = connection.execute(
                f"SELECT {_LISTED}, count(*) OVER () FROM {INDEX} WHERE {condition} {_ORDER} LIMIT ? OFFSET ?",
                [*params, limit, offset]).fetchall()
        total = rows[0][-1] if rows else self.count(where)
        return RolloutPage(tuple(_listed(row[:-1]) for row in rows), total, offset, limit)

    def count(self, where: RolloutFilter) -> int:
        condition, params = where.where()
        with self.cursor() as connection:
            ((total,),) = connection.execute(f"SELECT count(*) FROM {INDEX} WHERE {condition}", params).fetchall()
        return total

    def facets(self) -> Facets:
        with self.cursor() as connection:
            def distinct(expression: str) -> tuple:
                return tuple(row[0] for row in connection.execute(
                    f"SELECT DISTINCT {expression} AS value FROM {INDEX} ORDER BY value").fetchall()
                    if row[0] is not None)

            return Facets(distinct("iteration"), distinct("finish_reason"), distinct("unnest(error_types)"),
                          distinct("collect_view"))

    def group(self, group_id: str, iteration: int) -> tuple[ListedRollout, ...]:
        """Every indexed rollout of a GRPO group, by sample index."""
        with self.cursor() as connection:
            rows = connection.execute(
                f"SELECT {_LISTED} FROM {INDEX} WHERE group_id = ? AND iteration = ? {_ORDER}",
                [group_id, iteration]).fetchall()
        return tuple(_listed(row) for row in rows)

    def listed(self, rollout_id: str) -> ListedRollout | None:
        with self.cursor() as connection:
            rows = connection.execute(f"SELECT {_LISTED} FROM {INDEX} WHERE rollout_id = ?",
                                           [rollout_id]).fetchall()  # fetchall: no result left open
        return _listed(rows[0]) if rows else None

    # -----------------------------------------------------------------------------------------
    # One rollout: what show.load_inspection reads

    def read_rollout(self, rollout_id: str, connection: object = None) -> tuple[Rollout | None, list[Segment]]:
        """The rollout and its segments in seq order, from its two part files when it is indexed;
        an evaluation's through the views. (None, []) if unknown. `connection` is ignored: the
        snapshot's is used."""
        with self.cursor() as connection:
            found = connection.execute(f"SELECT part FROM {INDEX} WHERE rollout_id = ?", [rollout_id]).fetchall()
            if not found or found[0][0] is None:
                return self.warehouse.read_rollout(rollout_id, connection)
            part = Path(found[0][0])
            twin = self.root / schema.SEGMENTS.name / part.relative_to(self.root / schema.ROLLOUTS.name)
            rollouts = _read(connection, schema.ROLLOUTS, part, rollout_id, "", self.root)
            segments = _read(connection, schema.SEGMENTS, twin, rollout_id, "ORDER BY seq", self.root)
        return (rollouts[0] if rollouts else None), segments

    def read_purified_of(self, rollout_id: str, iteration: int,
                         connection: object = None) -> list[tuple[PurifiedRow, PurifyConfigRow | None]]:
        with self.cursor() as own:
            return self.warehouse.read_purified_of(rollout_id, iteration, own)

    def collect_config(self, iteration: int) -> str | None:
        return self.warehouse.collect_config(iteration)

    def eval_config(self, eval_id: str) -> str | None:
        return self.warehouse.eval_config(eval_id)


def _read(connection: duckdb.DuckDBPyConnection, dataset: schema.Dataset, part: Path, rollout_id: str,
          order: str, root: Path) -> list:
    """One rollout's rows of one part file."""
    try:
        table = connection.sql(
            f"SELECT {', '.join(dataset.columns)} FROM read_parquet(?, hive_partitioning = false) "
            f"WHERE rollout_id = ? {order}", params=[str(part), rollout_id]).to_arrow_table()
    except duckdb.Error as error:  # removed since the snapshot, e.g. by a compaction
        raise _stale(root, error, f"{part} cannot be read") from error
    return schema.from_table(dataset, table)


# ---------------------------------------------------------------------------------------------
# The pages' database


class _Pages:
    """One snapshot's database for the pages: the views, the rollout index, and a pool of cursors,
    each lent to one thread at a time. Its temporary directory (where DuckDB spills) is a private
    one, never under the warehouse."""

    def __init__(self, warehouse: Warehouse, size: int) -> None:
        self._temp = tempfile.TemporaryDirectory(prefix="cleaner-ui-", ignore_cleanup_errors=True)
        self.connection = warehouse.connect(settings={"temp_directory": self._temp.name}, warn_foreign=False)
        variable = parts_variable(schema.ROLLOUTS)
        ((has_parts,),) = self.connection.execute("SELECT count(*) FROM duckdb_variables() WHERE name = ?",
                                                  [variable]).fetchall()
        columns = ", ".join(schema.ROLLOUTS.columns)
        rollouts = (f"SELECT {columns}, filename AS part FROM read_parquet(getvariable('{variable}'), "
                    "hive_partitioning = false, filename = true)" if has_parts
                    else "SELECT *, NULL::VARCHAR AS part FROM rollouts")
        self.connection.execute(_INDEX_SQL.format(rollouts=rollouts))
        readonly.lock_down(self.connection, warehouse.root)
        self._idle: queue.SimpleQueue[duckdb.DuckDBPyConnection] = queue.SimpleQueue()
        for _ in range(size):
            self._idle.put(cursor_of(self.connection))
        self._lent = 0
        self._retired = False
        self._count = threading.Lock()  # guards _lent and _retired

    def index(self) -> pa.Table:
        """The rollout index, for the SQL box's database."""
        self.reserve()
        with self.cursor() as cursor:
            return cursor.sql(f"SELECT * FROM {INDEX}").to_arrow_table()

    def reserve(self) -> None:
        """Count a read that will take a cursor, so the database stays open for it."""
        with self._count:
            self._lent += 1

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for the block; the caller reserved it."""
        cursor = self._idle.get()  # waits only for another page's read
        try:
            yield cursor
        finally:
            with self._count:
                self._lent -= 1
                self._idle.put(cursor)
                if self._retired and self._lent == 0:
                    self._close()

    def retire(self) -> None:
        """Close the database once no cursor is lent (now, or when the last one comes back):
        closing it closes its cursors, so reads in flight finish first."""
        with self._count:
            self._retired = True
            if self._lent == 0:
                self._close()

    def _close(self) -> None:
        self.connection.close()  # and every cursor
        self._temp.cleanup()
