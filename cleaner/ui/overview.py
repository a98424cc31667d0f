"""The overview page: `cleaner report`'s figures as SVG, and its frames as tables.

The frames come from `cleaner.report.job.report_data` (the report's own queries, cleaner.warehouse.
queries) and the figures from the report's section plan (`cleaner.report.page.planned_sections`), so the
page and `cleaner report` cannot disagree. A figure is drawn the first time it is asked for and
kept until the next snapshot; SVG text needs no font or script from anywhere.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import PurePath

import polars as pl

from cleaner.report.job import report_data
from cleaner.report.page import Planned, ReportData, planned_sections
from cleaner.report.tables import missing


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def table(frame: pl.DataFrame | None) -> Table | None:
    """A frame as text cells (floats to 4 significant digits); None when empty."""
    if frame is None or frame.is_empty():
        return None

    def cell(value: object) -> str:
        if missing(value):
            return ""
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return Table(tuple(frame.columns), tuple(tuple(cell(v) for v in row) for row in frame.iter_rows()))


@dataclass(frozen=True)
class Chart:
    title: str
    caption: str
    name: str  # the SVG's name under /charts/
    skipped: str | None  # why there is no figure


class Overview:
    """The report's data for one snapshot, and its figures drawn on demand."""

    def __init__(self, connection) -> None:
        self.data: ReportData = report_data(connection)
        self._planned = {PurePath(p.file).stem: p for p in planned_sections(self.data)}
        self._svg: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def charts(self) -> list[Chart]:
        return [Chart(p.title, p.caption, name, p.skipped) for name, p in self._planned.items()]

    @property
    def iterations(self) -> Table | None:
        return table(self.data.iterations)

    @property
    def eval_runs(self) -> Table | None:
        return table(self.data.eval_runs)

    def svg(self, name: str) -> bytes | None:
        """The named figure as SVG; None if there is no such figure (or its data is missing)."""
        planned: Planned | None = self._planned.get(name)
        if planned is None or planned.build is None:
            return None
        with self._lock:
            if name not in self._svg:
                buffer = io.BytesIO()
                planned.build().savefig(buffer, format="svg")
                self._svg[name] = buffer.getvalue()
            return self._svg[name]
