"""`cleaner report`: the figures of a warehouse as PNGs and a Markdown page that embeds them.

Design decisions:
- The page is a fixed list of sections, each a figure with a one-line caption. A section whose
  data the warehouse lacks (no run, no training, no ablation) is kept with one line saying what
  is missing, so a short page is never mistaken for a broken one. Eval results are the exception:
  most warehouses have none, and their section appears only when `eval_runs` holds rows
  (cleaner.warehouse.queries).
- Figures are built and saved one at a time, so a long run's report holds one figure in memory.
- The page is written last, with links relative to it: the output directory can be moved whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from matplotlib.figure import Figure

from cleaner.report import figures


@dataclass(frozen=True)
class ReportData:
    """What a report plots (frames from cleaner.warehouse.queries); an empty frame means none."""

    rollouts: int
    iterations_collected: int
    iterations: pl.DataFrame
    train_steps: pl.DataFrame
    error_types: pl.DataFrame
    ablation: pl.DataFrame
    eval_runs: pl.DataFrame | None  # None: the warehouse holds no eval results
    findings: tuple[str, ...] = ()  # what the readers' gate finds (warehouse/gate.py): the figures cover what is stored


@dataclass(frozen=True)
class Section:
    title: str
    caption: str
    file: str | None  # the PNG's name in the output directory; None when skipped
    skipped: str | None = None  # why there is no figure
    table: str | None = None  # a Markdown table under the figure


@dataclass(frozen=True)
class Report:
    page: Path  # report.md
    sections: tuple[Section, ...]
    findings: tuple[str, ...] = ()  # the readers' gate's findings, at the top of the page

    @property
    def figures(self) -> list[Path]:
        return [self.page.parent / s.file for s in self.sections if s.file is not None]


@dataclass(frozen=True)
class Planned:
    """A section before its figure is drawn (`cleaner ui` draws the same ones as SVG)."""

    title: str
    file: str
    caption: str
    build: Callable[[], Figure] | None  # None: skipped, for the reason below
    skipped: str | None = None
    table: str | None = None


NO_RUN = "no `iterations` rows: this warehouse holds no completed `cleaner run` iteration"


def _planned(title: str, file: str, caption: str, build: Callable[[], Figure] | None, missing: str | None,
             table: str | None = None) -> Planned:
    """A section with its figure, or skipped when `missing` says what data it lacks."""
    return Planned(title, file, caption, build if missing is None else None, missing, table)


def _run_sections(data: ReportData) -> list[Planned]:
    frame = data.iterations
    missing = NO_RUN if frame.is_empty() else None
    classes = pl.col("clean_rollouts") + pl.col("recovered_rollouts") + pl.col("unrecovered_rollouts")
    no_premise = missing or (None if frame.select(classes.sum()).item() else
                             "the `iterations` rows carry no premise diagnostic")
    return [
        _planned("Accuracy", "accuracy.png", "Share of rollouts answered correctly, per iteration.",
                 lambda: figures.accuracy_figure(frame), missing),
        _planned("Tool failures", "failures.png",
                 "Failed calls per trajectory (left) and the share of first calls that failed (right).",
                 lambda: figures.failures_figure(frame), missing),
        _planned("SAAR merges", "merges.png",
                 "Merges in the run's purified rows: shallow (the fix's call under the original "
                 "reasoning), deep (the whole turn replaced), gated (rejected by the IS gate).",
                 lambda: figures.merges_figure(frame), missing),
        _planned("Premise diagnostic", "premise.png",
                 "Accuracy and count of clean, recovered and unrecovered rollouts (top): recovered about as "
                 "accurate as clean means purifying removes noise the reward cannot see. The credit of failed "
                 "calls (bottom): the mean advantage of their tokens under the raw view and the share of them "
                 "in positive-advantage rollouts; positive credit is what outcome-only GRPO reinforces.",
                 lambda: figures.premise_figure(frame), no_premise),
    ]


def _other_sections(data: ReportData) -> list[Planned]:
    steps, errors, grid, runs = data.train_steps, data.error_types, data.ablation, data.eval_runs
    planned = [
        _planned("Train metrics", "train.png",
                 "Loss, clip fraction, approximate KL and gradient norm per optimiser step; dotted "
                 "lines mark where each iteration's training starts.",
                 lambda: figures.train_figure(steps),
                 "no `train_steps` rows: nothing was trained into this warehouse" if steps.is_empty() else None),
        _planned("Error types", "error_types.png",
                 "Failed calls per trajectory by error type (the exception's name, else the call's "
                 "status), per iteration.",
                 lambda: figures.error_types_figure(errors),
                 "no failed tool calls in this warehouse" if errors.is_empty() else None),
    ]
    if grid.is_empty():
        planned.append(_planned("Ablation grid", "ablation.png", "", None,
                                "no ablation: no iteration is purified under two or more configs "
                                "(`cleaner ablate` makes one)"))
    for iteration in sorted(set(grid["iteration"].to_list())):
        one = grid.filter(pl.col("iteration") == iteration)
        planned.append(_planned(
            f"Ablation grid, iteration {iteration}", f"ablation-iteration-{iteration}.png",
            f"The {one.height} purify configs of iteration {iteration}: rollouts rolled back, merges, "
            "tokens removed and unrecovered chains per config.",
            lambda one=one: figures.ablation_figure(one), None, _ablation_table(one)))
    if runs is not None and not runs.is_empty():
        planned.append(_planned(
            "Eval results", "eval.png",
            "avg@n (left) and failed calls per trajectory (right) per dataset and model, from `eval_runs`.",
            lambda: figures.eval_figure(runs), None, _eval_table(runs)))
    return planned


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    def cell(value: object) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _ablation_table(grid: pl.DataFrame) -> str:
    columns = ["config_id", "rollouts", "rolled_back", "shallow", "deep", "gated", "unrecovered",
               "tokens_removed", "negatives"]
    rows = [[figures.config_label(row).replace("\n", " "), *(row[c] for c in columns)]
            for row in grid.iter_rows(named=True)]
    return markdown_table(rows, ["config", *columns])


def _eval_table(runs: pl.DataFrame) -> str:
    columns = ["model", "dataset", "saar", "avg_at_n", "pass_at_k", "failures_per_trajectory"]
    return markdown_table(runs.select(columns).rows(), ["model", "dataset", "saar", "avg@n", "pass@k",
                                                        "failures/trajectory"])


def _section_text(section: Section) -> str:
    lines = [f"## {section.title}", ""]
    if section.file is None:
        lines.append(f"*Skipped: {section.skipped}.*")
    else:
        lines += [f"![{section.title}]({section.file})", "", f"*{section.caption}*"]
    if section.table:
        lines += ["", section.table]
    return "\n".join(lines)


def planned_sections(data: ReportData) -> list[Planned]:
    """The report's sections in page order, each with its figure's builder or why it is skipped."""
    return _run_sections(data) + _other_sections(data)


def write_report(data: ReportData, out: Path, source: str) -> Report:
    """Write every figure the data allows into `out`, then `out/report.md`."""
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for planned in planned_sections(data):
        if planned.build is None:
            sections.append(Section(planned.title, planned.caption, None, planned.skipped, planned.table))
            continue
        figures.save_png(planned.build(), out / planned.file)
        sections.append(Section(planned.title, planned.caption, planned.file, None, planned.table))
    completed = data.iterations.height
    intro = (f"Warehouse `{source}`: {data.rollouts} rollouts in {data.iterations_collected} collected "
             f"iteration(s), {completed} completed `cleaner run` iteration(s), "
             f"{data.train_steps.height} optimiser step(s).")
    found = ["**Not as collected** (every reader but the report refuses it; the figures show what is stored):\n\n"
             + "\n".join(f"- {line}" for line in data.findings)] if data.findings else []
    text = "\n\n".join(["# cleaner report", intro, *found, *(_section_text(s) for s in sections)]) + "\n"
    page = out / "report.md"
    page.write_text(text)
    return Report(page, tuple(sections), data.findings)
