"""`cleaner report`: a warehouse's figures, read-only; a job beside `cleaner.jobs`.

Kept out of `jobs.py` so that plotting a warehouse loads neither torch nor transformers: it needs
the warehouse's SQL views (cleaner.warehouse.queries), polars and matplotlib only.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from cleaner.engine.report_page import Report, ReportData, write_report
from cleaner.errors import CleanerError
from cleaner.warehouse import Warehouse, queries


class ReportError(CleanerError):
    """The report cannot be written where asked."""


def report_job(warehouse: Warehouse, out: Path) -> Report:
    """Plot a warehouse: PNGs and `out/report.md` embedding them (cleaner.engine.report_page)."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: exists and is not a directory; give --out a directory")
    connection = warehouse.connect()
    try:
        data = report_data(connection)
    finally:
        connection.close()
    return write_report(data, out, str(warehouse.root))


def report_data(connection: duckdb.DuckDBPyConnection) -> ReportData:
    """Every frame the report plots, over one of `Warehouse.connect()`'s connections (the report
    and `cleaner ui`'s overview draw the same figures from it)."""
    sizes = queries.counts(connection)
    return ReportData(
        rollouts=sizes.rollouts, iterations_collected=sizes.iterations_collected,
        iterations=queries.iteration_curves(connection), train_steps=queries.train_curves(connection),
        error_types=queries.error_types(connection), ablation=queries.ablation_grid(connection),
        eval_runs=queries.eval_results(connection))
