"""The warehouse's SQL side: one DuckDB view per dataset over its verified parts, and the
convenience views (docs/architecture.md §3, "SQL").

`Warehouse.connect()` (store.py) decides which parts are visible and verifies them; `open_views`
builds the views over exactly those files. A view reads an explicit file list bound as a DuckDB
variable, never spelled as SQL text, and a dataset without parts gets an empty view with its
columns. Parts written before a column was added lack it: matched by name, then defaulted.

`through_arrow` reads the parts through pyarrow datasets registered on the connection instead:
DuckDB then opens no file of the warehouse, so a connection whose file access is limited to
another directory (`cleaner sql --allow-write DIR`) has no path into the warehouse at all, not
even to a part it reads (DuckDB's `allowed_paths` would let a COPY overwrite that part). Such
views belong to that one connection (`cursor_of` does not carry them).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.dataset

from cleaner.warehouse.schema import DATASETS, Dataset


def open_views(visible: dict[str, list[Path]], settings: dict[str, object] | None = None,
               through_arrow: bool = False) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per dataset over its `visible` parts, plus the
    convenience views; `settings` are DuckDB's, given when the database is opened;
    `through_arrow`: the parts are read by pyarrow, never opened by DuckDB (module docstring)."""
    connection = duckdb.connect(":memory:", config=settings or {})
    for dataset in DATASETS.values():
        _create_view(connection, dataset, visible[dataset.name], through_arrow)
    for name, query in CONVENIENCE_VIEWS.items():
        connection.execute(f"CREATE VIEW {name} AS {query}")
    return connection


def cursor_of(connection: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """A connection of its own to `connection`'s database, for another thread (a DuckDB connection
    serves one thread at a time), that reads the same views: DuckDB variables (the views' file lists)
    belong to a connection, so they are copied; tables and views belong to the database."""
    cursor = connection.cursor()
    for (name,) in connection.execute("SELECT name FROM duckdb_variables()").fetchall():
        ((value,),) = connection.execute("SELECT getvariable(?)", [name]).fetchall()
        cursor.execute(f"SET VARIABLE {name} = ?", [value])
    return cursor


def parts_variable(dataset: Dataset) -> str:
    """The DuckDB variable holding the file list of a dataset's view (unset when it has no parts)."""
    return f"_cleaner_parts_{dataset.name}"


def visible_of(connection: duckdb.DuckDBPyConnection) -> dict[str, list[Path]]:
    """The parts each view of `connection` (made by `open_views` from files) reads."""
    visible = {}
    for name, dataset in DATASETS.items():
        ((parts,),) = connection.execute("SELECT getvariable(?)", [parts_variable(dataset)]).fetchall()
        visible[name] = [Path(part) for part in parts or ()]  # unset (NULL) for a dataset without parts
    return visible


def _create_view(connection: duckdb.DuckDBPyConnection, dataset: Dataset, parts: list[Path],
                 through_arrow: bool = False) -> None:
    if not parts:
        _create_empty(connection, dataset)
        connection.execute(f"CREATE VIEW {dataset.name} AS SELECT * FROM _empty_{dataset.name}")
        return
    if through_arrow:  # pyarrow reads the parts, and a part without an added column reads it as null
        source = f"_arrow_{dataset.name}"
        connection.register(source, pyarrow.dataset.dataset([str(p) for p in parts], schema=dataset.schema,
                                                            format="parquet"))
    else:
        # The file list goes in as a bound parameter, not as SQL text: parsing thousands of quoted
        # paths costs DuckDB more than the rest of connect() together.
        connection.execute(f"SET VARIABLE {parts_variable(dataset)} = ?", [[str(p) for p in parts]])
        by_name = ", union_by_name = true" if dataset.added else ""
        source = f"read_parquet(getvariable('{parts_variable(dataset)}'), hive_partitioning = false{by_name})"
    columns = ", ".join(dataset.columns)
    if dataset.added:  # a part written before a column was added lacks it: matched by name, defaulted
        _create_empty(connection, dataset)
        source = f"(SELECT * FROM _empty_{dataset.name} UNION ALL BY NAME SELECT * FROM {source})"
        defaults = {name: _literal(value) for name, value in dataset.added if value is not None}
        columns = ", ".join(f"coalesce({c}, {defaults[c]}) AS {c}" if c in defaults else c for c in dataset.columns)
    connection.execute(f"CREATE VIEW {dataset.name} AS SELECT {columns} FROM {source}")


def _create_empty(connection: duckdb.DuckDBPyConnection, dataset: Dataset) -> None:
    """An empty table `_empty_<dataset>` with the dataset's columns."""
    copy_table(connection, f"_empty_{dataset.name}", dataset.schema.empty_table())


def copy_table(connection: duckdb.DuckDBPyConnection, name: str, table: object) -> None:
    """`table` (Arrow, or anything DuckDB registers) copied into the database as table `name`: a
    table of the database, not a registered object (those belong to one connection), so every
    cursor sees it."""
    connection.register("_copied", table)
    connection.execute(f"CREATE TABLE {name} AS SELECT * FROM _copied")
    connection.unregister("_copied")


def _literal(value: object) -> str:
    """A default of schema.py as SQL text (strings, booleans and numbers only)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    raise TypeError(f"no SQL literal for the column default {value!r}")


# Convenience views over the base views.
CONVENIENCE_VIEWS = {
    # Every assistant generation with the outcome of the call it made (NULL when it made none).
    "attempts": """
        SELECT a.rollout_id, a.iteration, a.seq, a.step, a.attempt,
               a.call_start IS NOT NULL AS has_call, a.tool_name, a.tool_code, len(a.token_ids) AS n_tokens,
               t.tool_status, t.error_type, t.exec_ms, a.text, t.text AS tool_response
        FROM segments a
        LEFT JOIN segments t
          ON t.rollout_id = a.rollout_id AND t.kind = 'tool' AND t.step = a.step AND t.attempt = a.attempt
        WHERE a.kind = 'assistant'
    """,
    # Tool failures with the rollout they belong to.
    "failures": """
        SELECT s.rollout_id, s.iteration, s.step, s.attempt, s.tool_name, s.tool_status, s.error_type, s.tool_code,
               r.correct, r.reward
        FROM segments s JOIN rollouts r USING (rollout_id)
        WHERE s.kind = 'tool' AND s.tool_status <> 'ok'
    """,
}
