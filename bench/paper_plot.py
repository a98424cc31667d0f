"""The figure of bench/paper_table.py: per-iteration metrics per arm, and the held-out accuracy."""

from __future__ import annotations

from pathlib import Path

import polars as pl


def plot(frame: pl.DataFrame, panels: dict[str, str], arms: list[str], path: Path, title: str,
         heldout: pl.DataFrame | None = None) -> None:
    """One panel per column of `panels` ({column: heading}) over iterations, one line per arm, and
    the held-out accuracy of the last checkpoints (bench/heldout.py's rows) if given."""
    import matplotlib  # matplotlib costs start-up time: loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (start-up time, as above)
    from matplotlib.ticker import MaxNLocator  # (start-up time, as above)

    figure, axes = plt.subplots(2, 4, figsize=(20, 8), constrained_layout=True)
    summary = frame.group_by("arm", "iteration").agg(
        *(pl.col(c).mean().alias(f"{c}_mean") for c in panels), *(pl.col(c).std().alias(f"{c}_std") for c in panels))
    for axis, (column, heading) in zip(axes.flat, panels.items(), strict=False):
        for arm in arms:
            data = summary.filter(pl.col("arm") == arm).sort("iteration")
            x = data["iteration"].to_list()
            mean = data[f"{column}_mean"].cast(pl.Float64).fill_null(float("nan")).to_numpy()
            std = data[f"{column}_std"].cast(pl.Float64).fill_null(0).to_numpy()
            style = {"color": "black", "linestyle": "--", "zorder": 5} if arm == "baseline" else {}
            (line,) = axis.plot(x, mean, marker="o", markersize=3, label=arm, **style)
            axis.fill_between(x, mean - std, mean + std, alpha=0.12, color=line.get_color())
        axis.set_title(heading)
        axis.set_xlabel("iteration")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    axes.flat[len(panels) - 1].axhline(0, color="grey", linewidth=1)
    axes.flat[0].legend(fontsize=8)
    if heldout is not None:
        plot_heldout(axes.flat[len(panels)], heldout, arms)
    else:
        axes.flat[len(panels)].set_visible(False)
    figure.suptitle(title + " (mean ± std over seeds)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_heldout(axis, heldout: pl.DataFrame, arms: list[str]) -> None:
    """Held-out accuracy per arm (mean ± std over seeds), raw and SAAR contexts side by side; the
    initial policy's as horizontal lines."""
    summary = (heldout.filter(pl.col("seed").is_not_null()).group_by("arm", "saar")
               .agg(pl.col("accuracy").mean().alias("mean"), pl.col("accuracy").std().alias("std")))
    for offset, saar in ((-0.2, False), (0.2, True)):
        rows = [summary.filter((pl.col("arm") == arm) & (pl.col("saar") == saar)) for arm in arms]
        means = [r["mean"][0] if not r.is_empty() else float("nan") for r in rows]
        stds = [(r["std"][0] or 0) if not r.is_empty() else 0 for r in rows]
        axis.bar([i + offset for i in range(len(arms))], means, width=0.4, yerr=stds, capsize=3,
                 label="SAAR context" if saar else "raw context")
        initial = heldout.filter((pl.col("arm") == "initial") & (pl.col("saar") == saar))
        if not initial.is_empty():
            axis.axhline(initial["accuracy"][0], color="C1" if saar else "C0", linestyle=":", linewidth=1)
    valid = summary["mean"].drop_nans().drop_nulls()
    if not valid.is_empty():
        axis.set_ylim(max(0.0, valid.min() - 0.1), min(1.0, valid.max() + 0.05))
    axis.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    axis.set_title("held-out accuracy, last checkpoints (dotted: initial)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")
