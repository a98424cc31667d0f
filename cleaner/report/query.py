"""`cleaner sql`'s job: a query over the warehouse views, checked, run read-only and interruptible,
and its result rendered as a table, CSV or JSON, printed or written to a file whole or not at all.

The locks it runs under (what a statement may read and write) are warehouse/readonly.py's; what
it refuses is said in one line, each a CleanerError (docs/architecture.md §14).
"""

from __future__ import annotations

import io
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import duckdb
import polars as pl
from rich.console import Console

from cleaner.errors import CleanerError, WriteError
from cleaner.interrupts import QueryStop, watched
from cleaner.outputs import check_outside, write_file_atomically
from cleaner.report.tables import json_cells, result_table
from cleaner.warehouse import Warehouse
from cleaner.warehouse.readonly import check_reads, check_write_dir, sql_connection, statements_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SqlRequest:
    query: str
    output_format: str = "table"  # table | csv | json
    output: Path | None = None  # a file outside the warehouse; None: the result is returned to print
    allow_write: Path | None = None  # any statement runs, with file access under this directory only
    verify: bool = False  # re-read every part and compare its CRC-32 with the manifest's


def sql_job(store: Warehouse, request: SqlRequest):
    """Run the request: what to print (a rich table, or text), or None where there is nothing to
    print (a statement without a result, or one written to `request.output`)."""
    _check(store, request)
    try:
        with tempfile.TemporaryDirectory(prefix="cleaner-sql-") as spill:
            with QueryStop("interrupting the query", "the query was stopped; nothing was written"):
                table = _run(store, request, Path(spill))
            return None if table is None else _result(table, request)
    except duckdb.PermissionException as exc:
        reach = (f"with --allow-write, files under {request.allow_write} only" if request.allow_write is not None
                 else "without --allow-write, files under the warehouse only")
        raise CleanerError(f"query failed: {exc} (cleaner sql reaches {reach})") from exc
    except duckdb.Error as exc:
        raise CleanerError(f"query failed: {exc}") from exc


def _check(store: Warehouse, request: SqlRequest) -> None:
    """Everything `cleaner sql` refuses before it opens the warehouse."""
    try:
        empty = not statements_of(request.query)  # empty, blank or comments only
    except (duckdb.Error, ValueError):
        empty = False  # check_reads says what is wrong with it
    if empty:
        raise CleanerError(f"the query {request.query!r} holds no SQL statement; e.g. cleaner sql 'FROM rollouts "
                           "LIMIT 5'")
    if request.output is not None:
        check_outside(request.output, store.root, "--output")
    if request.allow_write is None:
        check_reads(request.query)
    else:
        check_write_dir(request.allow_write, store.root)


def _run(store: Warehouse, request: SqlRequest, spill: Path):
    """The last statement's result as an Arrow table (None for a statement that returns nothing)."""
    logger.debug("opening %s for a query", store.root)
    connection = sql_connection(store, spill, request.allow_write, verify_content=request.verify)
    try:
        with watched(connection):
            logger.debug("running the query")
            relation = connection.sql(request.query)  # None for statements that return nothing
            return relation.to_arrow_table() if relation is not None else None
    finally:
        connection.close()


def _result(table, request: SqlRequest):
    """The table rendered as asked: returned to print, or written to the request's output."""
    output = request.output
    if request.output_format == "table":
        if output is None:
            return result_table(table)
        sink = io.StringIO()  # what rich prints into a 200-column file
        Console(file=sink, width=200).print(result_table(table))
        text = sink.getvalue()
    else:
        csv = request.output_format == "csv"
        frame = pl.from_arrow(json_cells(table) if csv else table)  # CSV holds nested cells as JSON text
        text = frame.write_csv() if csv else frame.write_json()
    if output is None:
        return text
    if not output.parent.is_dir():  # a mistyped folder is refused, never made
        raise CleanerError(f"--output {output}: cannot write the result (No such file or directory: "
                           f"{output.parent})")
    try:
        write_file_atomically(output, text)
    except WriteError as exc:  # the file, why, and for a full disk what to free
        raise CleanerError(f"--output {exc}") from exc
    return None
