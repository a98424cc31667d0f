"""Per-iteration report of a run: a rich table and `report.png` (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl
from rich.table import Table

from cleaner.engine.records import IterationRow

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


def plot_report(rows: Sequence[IterationRow], path: Path) -> Path:
    """Curves of accuracy, tool failures, merges and phase seconds per iteration."""
    import matplotlib  # matplotlib costs start-up time: loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (start-up time, as above; after choosing the headless backend)

    frame = iterations_frame(rows)
    x = frame["iteration"].to_list()
    figure, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    panels = [
        (axes[0, 0], ["accuracy"], "accuracy"),
        (axes[0, 1], ["first_attempt_error_rate", "failures_per_trajectory"], "tool failures"),
        (axes[1, 0], ["n_shallow", "n_deep"], "SAAR merges"),
        (axes[1, 1], ["collect_s", "purify_s", "train_s"], "seconds per phase"),
    ]
    for axis, names, title in panels:
        for name in names:
            axis.plot(x, frame[name].to_list(), marker="o", label=name)
        axis.set_title(title)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
