"""`cleaner report`: a warehouse's figures, read-only; a job beside the stages' jobs.

It loads neither torch nor transformers (nothing under cleaner/report/ does): it needs the
warehouse's SQL views (cleaner.warehouse.queries), polars and matplotlib only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb

from cleaner.outputs import REPORT, atomic_directory, check_outside, check_replaceable
from cleaner.report.page import Report, ReportData, write_report
from cleaner.warehouse import Warehouse, queries
from cleaner.warehouse.gate import every_finding


def default_report_dir(warehouse: Path) -> Path:
    """`<name>-report/` beside the warehouse `<name>`: each warehouse its own report, so two
    warehouses in one directory never overwrite each other's."""
    resolved = Path(warehouse).resolve()  # `-w .` names the directory it is in
    return resolved.parent / f"{resolved.name}-report"


def report_job(warehouse: Warehouse, out: Path) -> Report:
    """Plot a warehouse: PNGs and `out/report.md` embedding them (cleaner.report.page).

    The report is written aside and swapped in whole (cleaner.outputs): `out` ends holding
    this report's files only, and is refused, untouched, unless it is absent, empty or a report
    cleaner wrote, and outside the warehouse. A display, it does not refuse what the readers' gate
    finds (an iteration being collected, a part the warehouse did not write): the page says it at the
    top."""
    warehouse.check_is_warehouse()  # -w at a run directory or at / is named first
    check_outside(out, warehouse.root, "--out")  # before reading anything
    check_replaceable(out, REPORT)
    connection = warehouse.connect(warn_foreign=False)  # the gate's findings name them
    try:
        data = dataclasses.replace(report_data(connection), findings=tuple(every_finding(warehouse)))
    finally:
        connection.close()
    with atomic_directory(out, REPORT) as temp_dir:
        written = write_report(data, temp_dir, str(warehouse.root))
    return dataclasses.replace(written, page=Path(out) / written.page.name)


def report_data(connection: duckdb.DuckDBPyConnection) -> ReportData:
    """Every frame the report plots, over one of `Warehouse.connect()`'s connections (the report
    and `cleaner ui`'s overview draw the same figures from it)."""
    sizes = queries.counts(connection)
    return ReportData(
        rollouts=sizes.rollouts, iterations_collected=sizes.iterations_collected,
        iterations=queries.iteration_curves(connection), train_steps=queries.train_curves(connection),
        error_types=queries.error_types(connection), ablation=queries.ablation_grid(connection),
        eval_runs=queries.eval_results(connection))
