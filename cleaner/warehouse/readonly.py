"""Read-only SQL over the warehouse views: for a query box anyone with the page can type into
(`cleaner ui`, docs/architecture.md §14), and for `cleaner sql`.

Design decisions:
- Two locks, each enough on its own for the worst cases. The statement: DuckDB's own parser splits
  the text (`duckdb.extract_statements`), and exactly one statement of type SELECT is run (WITH,
  VALUES, FROM-first, DESCRIBE and SUMMARIZE parse as SELECT); DROP, COPY, ATTACH, INSTALL, LOAD,
  PRAGMA, SET, CREATE, several statements, ... are refused with a message naming the type. The
  connection: after the views are made, `lock_down` allows file access under the warehouse root
  only (`allowed_directories` with `enable_external_access = false`), so `read_csv('/etc/...')`,
  `COPY ... TO`, `ATTACH` and extension installs fail even inside a SELECT, and then locks the
  configuration so no statement can undo it.
- The database is DuckDB's in-memory one: a query cannot write the warehouse's files, and the
  views read the parts through `read_parquet`, which opens them read-only.
- `cleaner sql` is held to the same two locks (`sql_connection`, `check_reads`: every statement
  of a SELECT type; EXPLAIN is not one, since EXPLAIN ANALYZE runs a COPY), unless `--allow-write
  DIR`: then any statement runs, on a connection whose file access is DIR alone (and its private
  temporary directory), with the views read through pyarrow (views.py, `through_arrow`), so no
  statement can open a file of the warehouse, not even to overwrite a part it reads. DIR must not
  be, hold or lie inside the warehouse. Writes through a symbolic link under DIR that points into
  the warehouse are DuckDB's to follow: DIR is checked, not every link in it.
- A result is cut at `max_rows` rows and at `max_chars` characters of its cells (said so, in
  `QueryResult.cut`), read from DuckDB a few rows at a time, so what a page renders is bounded and
  not only DuckDB's memory (one query once returned a 1 GB page). For a page each cell is also cut
  in DuckDB to `cell_chars` characters of its text (`CAST ... AS VARCHAR`), so a 100 MB string
  never reaches Python. A query running past `timeout_s` is interrupted.
- The SQL box has a database of its own (`SqlBox`), apart from the one the pages read: its own
  memory and thread limits (`SqlLimits`), so a runaway query can neither take the pages' memory
  nor their lock; one query at a time, and a second one is refused at once rather than queued
  behind it. It never spills to disk: DuckDB lets a connection read its temporary directory
  whatever `allowed_directories` says, so the box has none (a query past its memory fails, said
  so).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from cleaner.errors import CleanerError
from cleaner.warehouse.store import Warehouse
from cleaner.warehouse.views import copy_table, open_views, visible_of


class QueryRefused(CleanerError):
    """The text is not exactly one read-only SELECT, or DuckDB rejected it."""


def lock_down(connection: duckdb.DuckDBPyConnection, root: Path) -> None:
    """From now on the connection reads files under `root` only and its settings cannot change."""
    directory = str(root.resolve()) + "/"
    connection.execute("SET allowed_directories = ?", [[directory]])
    connection.execute("SET enable_external_access = false")
    connection.execute("SET lock_configuration = true")


def statements_of(query: str) -> list:
    """`query` split into statements by DuckDB's parser, on a database of its own that is closed
    after: the module-level `duckdb.extract_statements` starts DuckDB's default database, whose
    worker threads then live until the interpreter exits (and may still run while it tears down)."""
    with duckdb.connect(":memory:", config={"threads": 1}) as parser:
        return parser.extract_statements(query)


def _statements(query: str) -> list:
    """The statements of `query` as DuckDB's parser splits them, each with a type cleaner can name."""
    try:
        statements = statements_of(query)
        for statement in statements:
            statement.type  # noqa: B018 - raises for a type the Python client has no name for
    except duckdb.Error as error:
        raise QueryRefused(f"the query does not parse: {error}") from error
    except ValueError as error:  # UPDATE EXTENSIONS: "29 is not a valid StatementType"
        raise QueryRefused(f"the query holds a statement of a kind cleaner does not know ({error})") from error
    if not statements:
        raise QueryRefused("the query is empty: write one SELECT (or WITH ... SELECT) statement")
    return statements


def check_select(query: str) -> str:
    """The one SELECT statement of `query`, or QueryRefused saying what it is instead."""
    statements = _statements(query)
    if len(statements) > 1:
        raise QueryRefused(f"{len(statements)} statements: only one SELECT statement is run at a time")
    (statement,) = statements
    if statement.type != duckdb.StatementType.SELECT:
        kind = _kind(statement)
        article = "an" if kind[0] in "AEIOU" else "a"
        raise QueryRefused(f"{article} {kind} statement: the warehouse is read-only here, only SELECT "
                           "(or WITH ... SELECT) statements are run")
    return query


def check_reads(query: str) -> int:
    """How many statements `query` holds, each of a SELECT type (they read); QueryRefused naming
    the first that is not (it may write, attach or change a setting)."""
    statements = _statements(query)
    for number, statement in enumerate(statements, 1):
        if statement.type != duckdb.StatementType.SELECT:
            kind = _kind(statement)
            article = "an" if kind[0] in "AEIOU" else "a"
            which = f"statement {number} of {len(statements)} is" if len(statements) > 1 else "it is"
            raise QueryRefused(f"{which} {article} {kind} statement, which may write, attach or change a setting: "
                               "cleaner sql runs SELECT statements (WITH, FROM, DESCRIBE, SHOW, SUMMARIZE ...); "
                               "--allow-write DIR runs any statement, with files under DIR only")
    return len(statements)


def sql_connection(warehouse: Warehouse, temp_dir: Path, write_dir: Path | None = None,
                   verify_content: bool = False) -> duckdb.DuckDBPyConnection:
    """`cleaner sql`'s connection: the views, spilling into `temp_dir`, locked to the warehouse
    (reads), or with `write_dir` to that directory alone, the views read through pyarrow (module
    docstring)."""
    settings = {"temp_directory": str(temp_dir)}
    connection = warehouse.connect(verify_content=verify_content, settings=settings)
    if write_dir is None:
        lock_down(connection, warehouse.root)
        return connection
    visible = visible_of(connection)
    connection.close()
    connection = open_views(visible, settings, through_arrow=True)
    lock_down(connection, write_dir)
    return connection


def check_write_dir(write_dir: Path, root: Path) -> None:
    """QueryRefused unless `write_dir` is a directory apart from the warehouse: not it, not in it,
    not holding it (symbolic links followed)."""
    if not write_dir.is_dir():
        raise QueryRefused(f"--allow-write {write_dir}: no such directory; give an existing directory outside "
                           "the warehouse")
    resolved, warehouse = write_dir.resolve(), root.resolve()
    if resolved == warehouse or warehouse in resolved.parents or resolved in warehouse.parents:
        relation = "is" if resolved == warehouse else "is inside" if warehouse in resolved.parents else "holds"
        raise QueryRefused(f"--allow-write {write_dir} {relation} the warehouse {root}: statements may write "
                           "only outside it; give a directory apart from the warehouse")


def _kind(statement) -> str:
    """The statement's type as its user wrote it: DuckDB parses INSTALL as a LOAD statement."""
    kind = str(statement.type).rsplit(".", 1)[-1]
    words = statement.query.split()
    if kind == "LOAD" and words and words[0].upper() in ("INSTALL", "FORCE"):
        return "INSTALL"
    return kind


@dataclass(frozen=True)
class QueryResult:
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]  # at most max_rows, and at most max_chars characters of cells
    cut: str | None = None  # why rows are missing, e.g. "the first 1,000 rows"; None: every row

    @property
    def truncated(self) -> bool:
        return self.cut is not None


BATCH_ROWS = 16  # rows read from DuckDB at a time, so a cut by size holds at most one batch more
CUT_MARK = " …"  # ends a cell cut to `cell_chars`


def run_select(connection: duckdb.DuckDBPyConnection, query: str, max_rows: int, timeout_s: float = 30.0,
               max_chars: int | None = None, cell_chars: int | None = None) -> QueryResult:
    """Check and run one SELECT; its first `max_rows` rows, and no more than `max_chars`
    characters of cells; with `cell_chars` every cell is its text, cut to that many characters
    (module docstring). QueryRefused for anything else, for a query DuckDB rejects (unknown
    column, file outside the warehouse) and for one past `timeout_s`."""
    check_select(query)
    timer = threading.Timer(timeout_s, connection.interrupt)
    timer.start()
    try:
        relation = connection.sql(query)
        columns = tuple(relation.columns)
        if cell_chars is not None:  # one more character says the cell was cut
            relation = relation.project(f"left(CAST(COLUMNS(*) AS VARCHAR), {int(cell_chars) + 1})")
        reader = relation.limit(max_rows + 1).to_arrow_reader(BATCH_ROWS)  # the row cut happens in DuckDB
        rows, cut = _read_capped(reader, max_rows, max_chars)
    except duckdb.InterruptException as error:
        raise QueryRefused(f"the query ran past {timeout_s:g} s and was interrupted") from error
    except duckdb.IOException as error:
        raise QueryRefused(f"the query failed: {error} (a part that is gone: the warehouse changed since the "
                           "browser's snapshot, e.g. by cleaner compact; refresh and run it again)") from error
    except duckdb.Error as error:
        raise QueryRefused(f"the query failed: {error}") from error
    finally:
        timer.cancel()
    if cell_chars is not None:
        rows = [tuple(_cut(cell, cell_chars) for cell in row) for row in rows]
    return QueryResult(columns, tuple(rows), cut)


def _read_capped(reader, max_rows: int, max_chars: int | None) -> tuple[list[tuple], str | None]:
    """The rows of `reader` up to `max_rows` rows and `max_chars` characters; why it stopped."""
    rows, chars = [], 0
    for batch in reader:
        for row in zip(*(column.to_pylist() for column in batch.columns), strict=True):
            if len(rows) == max_rows:
                return rows, f"the first {max_rows:,} rows"
            chars += sum(_chars(cell) for cell in row)
            if max_chars is not None and chars > max_chars:
                return rows, f"the first {len(rows):,} rows: the next would pass {max_chars:,} characters"
            rows.append(row)
    return rows, None


def _chars(cell: object) -> int:
    if cell is None:
        return 0
    return len(cell) if isinstance(cell, str) else len(str(cell))


def _cut(cell: str | None, cell_chars: int) -> str | None:
    if cell is None or len(cell) <= cell_chars:
        return cell
    return cell[:cell_chars] + CUT_MARK


class QueryBusy(QueryRefused):
    """Another query is running in the SQL box."""


@dataclass(frozen=True)
class SqlLimits:
    """What one query of the SQL box may take."""

    timeout_s: float = 30.0  # interrupted past this
    memory_mb: int = 2048  # DuckDB's memory limit for the box's database (it never spills to disk)
    threads: int = 1  # DuckDB's threads for it: the pages keep the rest of the CPU

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.threads < 1:
            raise ValueError(f"SQL box limits must be positive, got {self}")


def sql_settings(limits: SqlLimits) -> dict[str, object]:
    """The DuckDB settings the SQL box's database opens with."""
    return {"threads": limits.threads, "memory_limit": f"{limits.memory_mb}MB", "temp_directory": ""}


class SqlBox:
    """The SQL box: its own database (the warehouse's views, and `tables` copied in), locked down,
    running one query at a time (module docstring)."""

    def __init__(self, connection: duckdb.DuckDBPyConnection, root: Path, limits: SqlLimits,
                 tables: dict[str, object] | None = None) -> None:
        for name, table in (tables or {}).items():
            copy_table(connection, name, table)
        lock_down(connection, root)
        self.connection, self.limits = connection, limits
        self._running = threading.Lock()
        self._since = 0.0  # monotonic start of the running query
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether a query is running."""
        return self._running.locked()

    def run(self, query: str, max_rows: int, max_chars: int | None = None,
            cell_chars: int | None = None) -> QueryResult:
        """Check and run one SELECT (`run_select`); QueryBusy at once while another runs."""
        check_select(query)
        if not self._running.acquire(blocking=False):
            running_s = time.monotonic() - self._since
            raise QueryBusy(f"another query is running (for {running_s:.0f} s; it is stopped at "
                            f"{self.limits.timeout_s:g} s): one query runs at a time, run this one after it")
        try:
            if self._closed:
                raise QueryRefused("the browser took a new snapshot; run the query again")
            self._since = time.monotonic()
            return run_select(self.connection, query, max_rows, self.limits.timeout_s, max_chars, cell_chars)
        except QueryRefused:
            if self._closed:
                raise QueryRefused("the browser took a new snapshot while the query ran; run it again") from None
            raise
        finally:
            self._running.release()
            if self._closed:
                self._close_if_idle()

    def close(self) -> None:
        """Close the database; a running query is interrupted first and closes it when it ends."""
        self._closed = True
        if self._running.locked():
            self.connection.interrupt()
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._running.acquire(blocking=False):
            try:
                self.connection.close()
            finally:
                self._running.release()
