"""The per-iteration table `cleaner run` and `cleaner demo` print (the figures: `cleaner report`)."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
from rich.table import Table

from cleaner.records import IterationRow

COLUMNS = (
    ("iteration", "iter", "{:d}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("first_attempt_error_rate", "1st-call err", "{:.3f}"),
    ("failures_per_trajectory", "fail/traj", "{:.3f}"),
    ("n_shallow", "shallow", "{:d}"),
    ("n_deep", "deep", "{:d}"),
    ("collect_s", "collect s", "{:.1f}"),
    ("purify_s", "purify s", "{:.1f}"),
    ("train_s", "train s", "{:.1f}"),
)


def iterations_frame(rows: Sequence[IterationRow]) -> pl.DataFrame:
    """One row per iteration (the latest record wins if an iteration was logged twice)."""
    frame = pl.DataFrame([{name: getattr(r, name) for name, _, _ in COLUMNS} for r in rows])
    if frame.is_empty():
        return frame
    return frame.unique(subset="iteration", keep="last").sort("iteration")


def iteration_table(rows: Sequence[IterationRow], title: str = "cleaner run") -> Table:
    table = Table(title=title, header_style="bold")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for record in iterations_frame(rows).iter_rows(named=True):
        table.add_row(*(fmt.format(record[name]) for name, _, fmt in COLUMNS))
    return table
