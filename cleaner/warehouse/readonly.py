"""Read-only SQL over the warehouse views, for a query box anyone with the page can type into
(`cleaner ui`, docs/architecture.md §14).

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
- A result is cut at `max_rows` (said so), and a query running past `timeout_s` is interrupted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb

from cleaner.errors import CleanerError


class QueryRefused(CleanerError):
    """The text is not exactly one read-only SELECT, or DuckDB rejected it."""


def lock_down(connection: duckdb.DuckDBPyConnection, root: Path) -> None:
    """From now on the connection reads files under `root` only and its settings cannot change."""
    directory = str(root.resolve()) + "/"
    connection.execute("SET allowed_directories = ?", [[directory]])
    connection.execute("SET enable_external_access = false")
    connection.execute("SET lock_configuration = true")


def check_select(query: str) -> str:
    """The one SELECT statement of `query`, or QueryRefused saying what it is instead."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as error:
        raise QueryRefused(f"the query does not parse: {error}") from error
    if not statements:
        raise QueryRefused("the query is empty: write one SELECT (or WITH ... SELECT) statement")
    if len(statements) > 1:
        raise QueryRefused(f"{len(statements)} statements: only one SELECT statement is run at a time")
    (statement,) = statements
    if statement.type != duckdb.StatementType.SELECT:
        kind = str(statement.type).rsplit(".", 1)[-1]
        raise QueryRefused(f"a {kind} statement: the warehouse is read-only here, only SELECT "
                           "(or WITH ... SELECT) statements are run")
    return query


@dataclass(frozen=True)
class QueryResult:
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]  # at most max_rows
    truncated: bool  # the query returned more than max_rows rows


def run_select(connection: duckdb.DuckDBPyConnection, query: str, max_rows: int,
               timeout_s: float = 30.0) -> QueryResult:
    """Check and run one SELECT; its first `max_rows` rows. QueryRefused for anything else, for a
    query DuckDB rejects (unknown column, file outside the warehouse) and for one past `timeout_s`."""
    check_select(query)
    timer = threading.Timer(timeout_s, connection.interrupt)
    timer.start()
    try:
        relation = connection.sql(query)
        columns = tuple(relation.columns)
        rows = relation.limit(max_rows + 1).fetchall()  # the cut happens in DuckDB
    except duckdb.InterruptException as error:
        raise QueryRefused(f"the query ran past {timeout_s:g} s and was interrupted") from error
    except duckdb.Error as error:
        raise QueryRefused(f"the query failed: {error}") from error
    finally:
        timer.cancel()
    return QueryResult(columns, tuple(rows[:max_rows]), len(rows) > max_rows)
