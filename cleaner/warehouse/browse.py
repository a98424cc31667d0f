"""The trajectory browser's reads (`cleaner ui`, docs/architecture.md §14): a rollout index, the
paged and filtered rollout list, one rollout read from its own part.

Design decisions:
- One `Browser` is a snapshot: one `connect()` of a read-only `Warehouse` (the manifest stays in
  memory, nothing is written), then an index, then the connection is locked down
  (`readonly.lock_down`). `refresh()` takes a new snapshot; until then new parts are not seen.
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
- The `Browser` reads what `cleaner.report.show.load_inspection` asks of a warehouse (`read_rollout`,
  `read_purified_of`, `collect_config`, `eval_config`), over its own connection.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from pathlib import Path

import duckdb

from cleaner.records import PurifiedRow, PurifyConfigRow, Rollout, Segment
from cleaner.warehouse import readonly, schema
from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.store import Warehouse, parts_variable

INDEX = "rollout_index"
CLASSES = ("clean", "recovered", "unrecovered")

_INDEX_SQL = """
CREATE TEMP TABLE rollout_index AS
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
    """A read-only, locked-down snapshot of a warehouse (module docstring). Not thread-safe: hold
    `lock` around every use of `connection` and of the reads."""

    def __init__(self, warehouse: Warehouse) -> None:
        if not warehouse.read_only:
            raise ValueError("the browser reads a Warehouse opened with read_only=True")
        self.warehouse = warehouse
        self.lock = threading.RLock()
        self.connection = self._open()

    @property
    def root(self) -> Path:
        return self.warehouse.root

    def _open(self) -> duckdb.DuckDBPyConnection:
        connection = self.warehouse.connect()
        variable = parts_variable(schema.ROLLOUTS)
        ((has_parts,),) = connection.execute("SELECT count(*) FROM duckdb_variables() WHERE name = ?",
                                             [variable]).fetchall()
        columns = ", ".join(schema.ROLLOUTS.columns)
        rollouts = (f"SELECT {columns}, filename AS part FROM read_parquet(getvariable('{variable}'), "
                    "hive_partitioning = false, filename = true)" if has_parts
                    else "SELECT *, NULL::VARCHAR AS part FROM rollouts")
        connection.execute(_INDEX_SQL.format(rollouts=rollouts))
        readonly.lock_down(connection, self.root)
        return connection

    def close(self) -> None:
        with self.lock:
            self.connection.close()

    def refresh(self) -> None:
        """A new snapshot: parts written since the last one become visible."""
        with self.lock:
            old, self.connection = self.connection, self._open()
            old.close()

    # -----------------------------------------------------------------------------------------
    # The list

    def list_rollouts(self, where: RolloutFilter, offset: int = 0, limit: int = 50) -> RolloutPage:
        condition, params = where.where()
        with self.lock:
            rows = self.connection.execute(
                f"SELECT {_LISTED}, count(*) OVER () FROM {INDEX} WHERE {condition} {_ORDER} LIMIT ? OFFSET ?",
                [*params, limit, offset]).fetchall()
            total = rows[0][-1] if rows else self.count(where)
        return RolloutPage(tuple(_listed(row[:-1]) for row in rows), total, offset, limit)

    def count(self, where: RolloutFilter) -> int:
        condition, params = where.where()
        with self.lock:
            ((total,),) = self.connection.execute(f"SELECT count(*) FROM {INDEX} WHERE {condition}", params).fetchall()
        return total

    def facets(self) -> Facets:
        def distinct(expression: str) -> tuple:
            return tuple(row[0] for row in self.connection.execute(
                f"SELECT DISTINCT {expression} AS value FROM {INDEX} ORDER BY value").fetchall() if row[0] is not None)

        with self.lock:
            return Facets(distinct("iteration"), distinct("finish_reason"), distinct("unnest(error_types)"),
                          distinct("collect_view"))

    def group(self, group_id: str, iteration: int) -> tuple[ListedRollout, ...]:
        """Every indexed rollout of a GRPO group, by sample index."""
        with self.lock:
            rows = self.connection.execute(
                f"SELECT {_LISTED} FROM {INDEX} WHERE group_id = ? AND iteration = ? {_ORDER}",
                [group_id, iteration]).fetchall()
        return tuple(_listed(row) for row in rows)

    def listed(self, rollout_id: str) -> ListedRollout | None:
        with self.lock:
            rows = self.connection.execute(f"SELECT {_LISTED} FROM {INDEX} WHERE rollout_id = ?",
                                           [rollout_id]).fetchall()  # fetchall: no result left open
        return _listed(rows[0]) if rows else None

    # -----------------------------------------------------------------------------------------
    # One rollout: what show.load_inspection reads

    def read_rollout(self, rollout_id: str, connection: object = None) -> tuple[Rollout | None, list[Segment]]:
        """The rollout and its segments in seq order, from its two part files when it is indexed;
        an evaluation's through the views. (None, []) if unknown. `connection` is ignored: the
        snapshot's is used."""
        with self.lock:
            found = self.connection.execute(f"SELECT part FROM {INDEX} WHERE rollout_id = ?", [rollout_id]).fetchall()
            if not found or found[0][0] is None:
                return self.warehouse.read_rollout(rollout_id, self.connection)
            part = Path(found[0][0])
            twin = self.root / schema.SEGMENTS.name / part.relative_to(self.root / schema.ROLLOUTS.name)
            rollouts = self._read(schema.ROLLOUTS, part, rollout_id, "")
            segments = self._read(schema.SEGMENTS, twin, rollout_id, "ORDER BY seq")
        return (rollouts[0] if rollouts else None), segments

    def _read(self, dataset: schema.Dataset, part: Path, rollout_id: str, order: str) -> list:
        try:
            table = self.connection.sql(
                f"SELECT {', '.join(dataset.columns)} FROM read_parquet(?, hive_partitioning = false) "
                f"WHERE rollout_id = ? {order}", params=[str(part), rollout_id]).to_arrow_table()
        except duckdb.Error as error:  # removed since the snapshot, e.g. by a compaction
            raise WarehouseError(f"{part}: cannot be read ({error}); refresh the browser") from error
        return schema.from_table(dataset, table)

    def read_purified_of(self, rollout_id: str, iteration: int,
                         connection: object = None) -> list[tuple[PurifiedRow, PurifyConfigRow | None]]:
        with self.lock:
            return self.warehouse.read_purified_of(rollout_id, iteration, self.connection)

    def collect_config(self, iteration: int) -> str | None:
        return self.warehouse.collect_config(iteration)

    def eval_config(self, eval_id: str) -> str | None:
        return self.warehouse.eval_config(eval_id)
