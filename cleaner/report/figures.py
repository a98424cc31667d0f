"""The figures of `cleaner report`: one function per figure, a polars frame in, a Figure out.

The frames come from `cleaner.warehouse.queries`, whose docstring says what each row is.

Design decisions:
- Figures use matplotlib's object API (`matplotlib.figure.Figure`), never pyplot: no global
  figure state and no GUI backend; saving a PNG renders with Agg whatever backend is configured.
- Every figure is WIDTH_PX x HEIGHT_PX, so report.md reads as a column of equal tiles and a test
  can check every file's size.
- Curves over iterations are lines with markers (runs have few iterations); train metrics are per
  optimiser step, on the run-wide `optimizer_step`, with a dotted line where each iteration's
  training starts.
- A missing value (a premise class empty in some iteration) is a gap, never a 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

WIDTH_PX, HEIGHT_PX, DPI = 960, 540, 100
TOP_ERROR_TYPES = 6  # the rest are summed as "other", so the legend stays readable


def new_figure(rows: int = 1, cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A WIDTH_PX x HEIGHT_PX figure and its axes, row by row."""
    figure = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    return figure, list(figure.subplots(rows, cols, squeeze=False).flat)


def save_png(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format="png")
    return path


def _values(frame: pl.DataFrame, column: str) -> list[float]:
    return [math.nan if value is None else float(value) for value in frame[column].to_list()]


def _style(axis: Axes, title: str, xlabel: str = "iteration", ylabel: str | None = None) -> None:
    axis.set_title(title)
    axis.set_xlabel(xlabel)
    if ylabel:
        axis.set_ylabel(ylabel)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)


def _lines(axis: Axes, frame: pl.DataFrame, columns: dict[str, str], x: str = "iteration") -> None:
    """One line per column ({column: legend label})."""
    for column, label in columns.items():
        axis.plot(frame[x].to_list(), _values(frame, column), marker="o", label=label)
    if len(columns) > 1:
        axis.legend(fontsize=8)


def _bars(axis: Axes, positions: list[float], series: dict[str, list[float]], width: float = 0.8) -> None:
    """Grouped bars: one bar per series at each position."""
    each = width / len(series)
    for index, (label, heights) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * each
        axis.bar([p + offset for p in positions], heights, each, label=label)
    axis.margins(y=0.2)  # headroom for the legend
    axis.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# Iterations of a run


def accuracy_figure(iterations: pl.DataFrame) -> Figure:
    figure, (axis,) = new_figure()
    _lines(axis, iterations, {"accuracy": "accuracy"})
    axis.set_ylim(0, 1)
    _style(axis, "accuracy per iteration", ylabel="share of rollouts correct")
    return figure


def failures_figure(iterations: pl.DataFrame) -> Figure:
    figure, (left, right) = new_figure(1, 2)
    _lines(left, iterations, {"failures_per_trajectory": "failed calls per trajectory"})
    _style(left, "failed calls per trajectory")
    _lines(right, iterations, {"first_attempt_error_rate": "first-call error rate"})
    right.set_ylim(0, 1)
    _style(right, "first-call error rate", ylabel="share of first calls that failed")
    return figure


def _stacked(axis, x: list, series: dict[str, list[float]]) -> None:
    """One stacked bar per x, a segment per series (in order), with a legend above the bars."""
    bottom = [0.0] * len(x)
    for label, heights in series.items():
        axis.bar(x, heights, 0.6, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.margins(y=0.2)  # headroom for the legend
    axis.legend(fontsize=8)


def merges_figure(iterations: pl.DataFrame) -> Figure:
    figure, (axis,) = new_figure()
    _bars(axis, _values(iterations, "iteration"), {
        "shallow": _values(iterations, "n_shallow"), "deep": _values(iterations, "n_deep"),
        "gated": _values(iterations, "n_gated")})
    _style(axis, "SAAR merges per iteration", ylabel="merges")
    return figure


def premise_figure(iterations: pl.DataFrame) -> Figure:
    """Accuracy and count per class (top); the credit of failed calls (bottom): their tokens' mean
    advantage beside the recovered rollouts', and the share of them in positive-advantage rollouts."""
    figure, (accuracy, count, credit, share) = new_figure(2, 2)
    classes = ("clean", "recovered", "unrecovered")
    _lines(accuracy, iterations, {f"{name}_accuracy": name for name in classes})
    accuracy.set_ylim(0, 1)
    _style(accuracy, "accuracy by class", ylabel="share correct")
    _stacked(count, _values(iterations, "iteration"),
             {name: _values(iterations, f"{name}_rollouts") for name in classes})
    _style(count, "rollouts by class", ylabel="rollouts")
    _lines(credit, iterations, {"failed_call_advantage": "failed-call tokens",
                                "recovered_advantage": "recovered rollouts"})
    credit.axhline(0, color="grey", linewidth=1)
    _style(credit, "credit of failed calls: mean advantage", ylabel="advantage")
    _lines(share, iterations, {"failed_call_positive_share": "share in positive rollouts"})
    share.set_ylim(0, 1)
    _style(share, "failed-call tokens in positive-advantage rollouts", ylabel="share of tokens")
    return figure


# ---------------------------------------------------------------------------------------------
# Training


TRAIN_PANELS = {"loss": "loss", "clip_fraction": "clip fraction", "approx_kl": "approximate KL",
                "grad_norm": "gradient norm (before clipping)"}


def train_figure(steps: pl.DataFrame) -> Figure:
    figure, axes = new_figure(2, 2)
    starts = steps.group_by("iteration").agg(pl.col("optimizer_step").min()).sort("iteration")
    for axis, (column, title) in zip(axes, TRAIN_PANELS.items(), strict=True):
        axis.plot(steps["optimizer_step"].to_list(), _values(steps, column), marker=".", linewidth=1)
        for start in starts["optimizer_step"].to_list()[1:]:
            axis.axvline(start - 0.5, color="grey", linestyle=":", linewidth=1)
        _style(axis, title, xlabel="optimizer step")
    return figure


# ---------------------------------------------------------------------------------------------
# Failures


def error_types_figure(errors: pl.DataFrame, top: int = TOP_ERROR_TYPES) -> Figure:
    """Stacked bars: failed calls per trajectory of each iteration, by error type."""
    ranked = errors.group_by("error").agg(pl.col("failures").sum()).sort(["failures", "error"],
                                                                       descending=[True, False])
    kept = ranked["error"].to_list()[:top]
    grouped = (errors.with_columns(pl.when(pl.col("error").is_in(kept)).then(pl.col("error"))
                                   .otherwise(pl.lit("other")).alias("error"))
               .group_by("iteration", "error").agg(pl.col("per_rollout").sum()))
    iterations = sorted(set(grouped["iteration"].to_list()))
    figure, (axis,) = new_figure()
    series = {}
    for error in kept + (["other"] if len(ranked) > top else []):
        share = dict(grouped.filter(pl.col("error") == error).select("iteration", "per_rollout").iter_rows())
        series[error] = [float(share.get(i, 0.0)) for i in iterations]
    _stacked(axis, iterations, series)
    _style(axis, "failed calls per trajectory by error type", ylabel="failed calls per trajectory")
    return figure


# ---------------------------------------------------------------------------------------------
# An ablation grid and eval results


def config_label(row: dict) -> str:
    """A purify config as its parameters that differ from the paper's defaults, one per line."""
    words = [f"γ={row['gamma']:g}", f"p={row['rollback_prob']:g}"]
    if row["similarity_on"] not in (None, "code"):
        words.append(f"on {row['similarity_on']}")
    if row["purify_when"] not in (None, "always"):
        words.append(str(row["purify_when"]))
    if row["is_threshold"]:
        words.append(f"τ={row['is_threshold']:g}")
    if row["negative_samples"]:
        words.append("negatives")
    if row.get("edit") not in (None, "replace"):
        words.append(str(row["edit"]))
    return "\n".join(words)


def ablation_figure(grid: pl.DataFrame) -> Figure:
    """One iteration's configs: what each did to the iteration's rollouts."""
    labels = [config_label(row) for row in grid.iter_rows(named=True)]
    x = list(range(grid.height))
    figure, axes = new_figure(2, 2)
    axes[0].bar(x, _values(grid, "rolled_back"), 0.6)
    axes[0].set_title("rollouts rolled back")
    _bars(axes[1], x, {name: _values(grid, name) for name in ("shallow", "deep", "gated")})
    axes[1].set_title("merges")
    axes[2].bar(x, _values(grid, "tokens_removed"), 0.6)
    axes[2].set_title("tokens removed")
    axes[3].bar(x, _values(grid, "unrecovered"), 0.6)
    axes[3].set_title("unrecovered chains")
    for axis in axes:
        axis.set_xticks(x, labels, fontsize=7)
        axis.grid(alpha=0.3, axis="y")
    return figure


def eval_series(runs: pl.DataFrame) -> pl.DataFrame:
    """One row per (dataset, series): a series is a model, or a model and its `saar` setting when
    several settings were evaluated; repeated evaluations are averaged."""
    several = runs["saar"].n_unique() > 1
    label = (pl.col("model") + " [" + pl.col("saar").fill_null("-") + "]") if several else pl.col("model")
    return (runs.with_columns(label.alias("series"))
            .group_by("dataset", "series", maintain_order=True)
            .agg(pl.col("avg_at_n").mean(), pl.col("failures_per_trajectory").mean()))


def eval_figure(runs: pl.DataFrame) -> Figure:
    table = eval_series(runs)
    datasets = list(dict.fromkeys(table["dataset"].to_list()))
    series = list(dict.fromkeys(table["series"].to_list()))
    figure, (left, right) = new_figure(1, 2)
    for axis, column, title in ((left, "avg_at_n", "avg@n"), (right, "failures_per_trajectory",
                                                               "failed calls per trajectory")):
        values = {(d, s): v for d, s, v in table.select("dataset", "series", column).iter_rows()}
        _bars(axis, list(range(len(datasets))),
              {s: [values.get((d, s), math.nan) for d in datasets] for s in series})
        axis.set_xticks(range(len(datasets)), datasets)
        axis.set_title(title)
        axis.grid(alpha=0.3, axis="y")
    left.set_ylim(0, 1)
    return figure
