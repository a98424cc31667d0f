"""Every table the CLI prints: query results (`cleaner sql`), a collection's summary (`cleaner
collect`), the purify configs compared and the premise (`cleaner purify`, `cleaner ablate`), the
evaluations (`cleaner eval`, also as JSON) and the iterations (`cleaner run`, `cleaner demo`; their
figures are `cleaner report`'s).

Design decisions:
- Every table prints a number through one of the few formatters below, one per kind of number, so
  a rate reads the same in every table: a share (accuracy, an error rate, pass@k) is a percentage
  with one decimal, a mean or a ratio has three decimals, an advantage its sign, a duration one
  decimal, and a missing value (None, or NaN: a rate whose denominator is empty) is "-" everywhere.
- A query result as CSV (`cleaner sql --format csv`, the browser's download) holds each nested
  cell (a token list, a struct, a map) as JSON text, which CSV readers take as one string.
- A query result's cells are plain text (brackets are not rich markup), with newlines and control
  characters escaped (`visible`): a model's output may hold any of them, and a terminal would obey
  them. Long cells and token lists are abbreviated.
- Beyond SAAR's own counters, each purify config reports the tokens it trains and how many of them
  are `ctx-rewritten`: loss tokens whose recomputed old log-prob differs from the behaviour
  log-prob (|diff| > 1e-3), i.e. tokens whose context purification rewrote after they were
  sampled. That is the off-policy share a config creates, which truncated IS
  (docs/architecture.md §7) can correct.
- Evaluations: one row per (model, dataset, SAAR setting). When both settings of a (model, dataset)
  ran, the SAAR row carries the latency ratio: its seconds per generated rollout over the raw
  setting's (cleaner/engine/eval/plan.py says why per generated rollout); the paper reports SAAR's
  test-time cost as this ratio. JSON holds every metric with `pass_at_k` as an object keyed by k;
  a rate with an empty denominator (NaN in the warehouse) is null, so the output is strict JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import pyarrow as pa
from rich.table import Table
from rich.text import Text

from cleaner.engine.collect.summary import CollectSummary
from cleaner.engine.saar.premise import PremiseStats
from cleaner.records import EvalRunRow, IterationRow

MAX_CELL_CHARS = 80

# ---------------------------------------------------------------------------------------------
# Numbers: one formatter per kind, used by every table (show.py's too)

MISSING = "-"  # None, or NaN: a rate whose denominator is empty, an empty class, an unknown


def missing(value: object) -> bool:
    """Whether `value` is absent: None, or a float NaN (a rate the warehouse could not compute)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def rate(value: float | None) -> str:
    """A share in [0, 1] (accuracy, an error rate, pass@k) as a percentage: 0.66667 -> 66.7%."""
    return MISSING if missing(value) else f"{value:.1%}"


def number(value: float | None) -> str:
    """A mean or a ratio (reward, failed calls per rollout, a latency ratio): 1.3125 -> 1.312."""
    return MISSING if missing(value) else f"{value:.3f}"


def signed(value: float | None) -> str:
    """An advantage, whose sign is the point: 0.3481 -> +0.348."""
    return MISSING if missing(value) else f"{value:+.3f}"


def seconds(value: float | None) -> str:
    """A duration in seconds: 19.24 -> 19.2."""
    return MISSING if missing(value) else f"{value:.1f}"


def setting(value: object) -> str:
    """A config's parameter or a count as set: a float to 6 significant digits (a float32 column's
    0.699999988 -> 0.7), anything else as text (an enum its value, an int its digits)."""
    if missing(value):
        return MISSING
    return f"{value:.6g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# Query results (`cleaner sql`)


# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI): a model's text may
# hold any of them, and a terminal would obey them.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with each control character written as its escape (ESC -> \\x1b, CR -> \\r), so
    printing a model's output shows it instead of moving the cursor or recolouring the terminal."""
    return _CONTROL.sub(lambda match: match.group(0).encode("unicode_escape").decode("ascii"), text)


def cell(value: object) -> Text:
    """A table cell: plain text (brackets are not rich markup), newlines and controls escaped."""
    if isinstance(value, list | tuple):
        inner = ", ".join(str(v) for v in value[:8])
        text = f"[{inner}{', ...' if len(value) > 8 else ''}] ({len(value)})"
    else:
        text = MISSING if missing(value) else str(value)
    text = visible(text.replace("\n", "\\n"))
    return Text(text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…")


def result_table(table: pa.Table, title: str | None = None) -> Table:
    """A rich table of a query result; long cells and token lists are abbreviated."""
    out = Table(title=title, show_lines=False, header_style="bold")
    for name in table.column_names:
        out.add_column(name, overflow="fold")
    for row in table.to_pylist():
        out.add_row(*(cell(row[name]) for name in table.column_names))
    out.caption = f"{table.num_rows} row{'s' if table.num_rows != 1 else ''}"
    return out


def csv_cell(value: object) -> object:
    """A value as a CSV cell: a nested one (a list, a struct, a map) as JSON text, a scalar as it is."""
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str, ensure_ascii=False)
    return value


def json_cells(table: pa.Table) -> pa.Table:
    """`table` with each nested column (lists, structs, maps) as JSON text, which CSV can hold."""
    for index, field in enumerate(table.schema):
        if pa.types.is_nested(field.type):
            text = pa.array([None if value is None else csv_cell(value) for value in table.column(index).to_pylist()],
                            pa.string())
            table = table.set_column(index, field.name, text)
    return table


# ---------------------------------------------------------------------------------------------
# A collection (`cleaner collect`)


def summary_table(summary: CollectSummary) -> Table:
    """Two-column rich table of a summary."""
    table = Table(title="collect", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("rollouts", setting(summary.rollouts)),
        ("accuracy", rate(summary.accuracy)),
        ("mean reward", number(summary.mean_reward)),
        ("tool calls", setting(summary.tool_calls)),
        ("failed calls", setting(summary.failed_calls)),
        ("failed calls / rollout", number(summary.failed_calls_per_rollout)),
        ("well-formed calls", rate(summary.well_formed_call_rate)),
        ("first-attempt error rate", rate(summary.first_attempt_error_rate)),
        ("retries", setting(summary.retries)),
        ("chains with a failure", setting(summary.chains_with_failure)),
        ("recovered chains", setting(summary.recovered_chains)),
        ("recovery rate", rate(summary.recovery_rate)),
    ]
    rows += [(f"failures: {name}", setting(n)) for name, n in summary.failures_by_error_type]
    rows += [(f"finish: {name}", setting(n)) for name, n in summary.finish_reasons]
    for metric, value in rows:
        table.add_row(metric, value)
    return table


# ---------------------------------------------------------------------------------------------
# Purify configs and the premise (`cleaner purify`, `cleaner ablate`)


REWRITTEN_TOLERANCE = 1e-3


def _token_counts(rows: Sequence) -> tuple[int, int]:
    trained = rewritten = 0
    for row in rows:
        for mask, old, behaviour in zip(row.loss_mask, row.old_logprobs, row.behavior_logprobs, strict=True):
            if mask:
                trained += 1
                rewritten += abs(old - behaviour) > REWRITTEN_TOLERANCE
    return trained, rewritten


def stats_frame(results: Sequence) -> pl.DataFrame:
    """One row per PurifyResult (config, rows, stats)."""
    records = []
    for result in results:
        config, stats = result.config, result.stats
        trained, rewritten = _token_counts(result.rows)
        records.append({
            "config_id": stats.config_id, "gamma": config.gamma, "p": config.rollback_prob,
            "sim": config.similarity_on, "when": config.purify_when, "tau": config.rollback_is_threshold,
            "neg": config.negative_samples, "edit": str(config.edit), "rollouts": stats.n_rollouts,
            "rolled": stats.n_rolled_back, "shallow": stats.n_shallow, "deep": stats.n_deep,
            "unrecov": stats.n_unrecovered, "infra": stats.n_infra_fault, "gated": stats.n_gated,
            "negatives": stats.n_negatives, "removed": stats.tokens_removed, "masked": stats.tokens_masked,
            "down": _down_sample(config), "void": config.void_turn_filter, "dropped": stats.n_dropped,
            "voided": stats.n_void,
            "trained": trained,
            "rewritten": rewritten,
        })
    return pl.DataFrame(records)


def _down_sample(config) -> str:
    """A config's down-sampling as the table shows it: none, roc->8, uniform->8."""
    return "none" if config.down_sample_to is None else f"{config.down_sample}->{config.down_sample_to}"


PARAMETERS = ("gamma", "p", "sim", "when", "tau", "neg", "edit", "down", "void")
# Counters shown only when some config sets their parameter off its default (parameter, default).
OPTIONAL = {"gated": ("tau", 0.0), "negatives": ("neg", False), "masked": ("edit", "replace"),
            "dropped": ("down", "none"), "voided": ("void", False)}


def stats_table(results: Sequence, title: str = "purify") -> Table:
    """The comparison table; of the parameters, only those that vary across configs are shown."""
    frame = stats_frame(results)
    if frame.is_empty():
        return Table(title=title)
    unused = [counter for counter, (parameter, default) in OPTIONAL.items() if (frame[parameter] == default).all()]
    unset = [OPTIONAL[counter][0] for counter in unused]  # their parameters are at the default everywhere
    constant = [name for name in PARAMETERS if name not in unset and frame[name].n_unique() == 1 and frame.height > 1]
    facts = [f"{frame['rollouts'][0]} rollouts"] + [f"{name} {setting(frame[name][0])}" for name in constant]
    title += " (" + ", ".join(facts) + ")"
    frame = frame.drop([*constant, *unset, *unused, "rollouts"]).with_columns(pl.col("config_id").str.slice(0, 8))
    table = Table(title=title, header_style="bold")
    for name in frame.columns:
        table.add_column(name, justify="left" if frame[name].dtype == pl.String else "right", no_wrap=True)
    for record in frame.iter_rows():
        table.add_row(*(setting(v) for v in record))
    errors = results[0].stats.errors_by_type if results else ()
    if errors:
        table.caption = "failed calls in the input: " + ", ".join(f"{name} {count}" for name, count in errors)
    return table


def premise_table(premise: PremiseStats, title: str = "premise") -> Table:
    """Clean, recovered and unrecovered rollouts: how many, how accurate, their mean advantage.

    Read first when deciding whether CLEANER can help on a dataset (cleaner.engine.saar.premise)."""
    table = Table(title=title, header_style="bold")
    for name in ("rollouts", "count", "accuracy", "mean advantage"):
        table.add_column(name, justify="left" if name == "rollouts" else "right")
    for name in ("clean", "recovered", "unrecovered"):
        stats = getattr(premise, name)
        table.add_row(name, setting(stats.rollouts), rate(stats.accuracy), signed(stats.mean_advantage))
    ratio = premise.recovered_over_clean
    credit = premise.credit
    if credit.tokens:
        table.add_section()
        table.add_row("failed-call tokens", setting(credit.tokens), f"{rate(credit.positive_share)} in +adv",
                      signed(credit.mean_advantage))
    table.caption = ("recovered / clean accuracy " + number(ratio)
                     + ": near 1, failed calls do not predict a wrong answer and purifying removes noise "
                       "the reward cannot see; well below 1, the reward already punishes them")
    if credit.tokens:
        table.caption += ("; failed-call tokens (raw view): their mean advantage is the credit GRPO gives "
                          "failed calls, positive = reinforced (the paper's premise), negative = already pushed down")
    return table


# ---------------------------------------------------------------------------------------------
# Evaluations (`cleaner eval`)


def _per_rollout(row: EvalRunRow) -> float | None:
    return row.seconds / row.rollouts_generated if row.rollouts_generated else None


def latency_ratios(rows: Sequence[EvalRunRow]) -> dict[str, float]:
    """eval_id of each SAAR row -> its seconds per generated rollout over its raw twin's."""
    raw = {(row.model, row.data_path): row for row in rows if not row.saar}
    ratios = {}
    for row in rows:
        twin = raw.get((row.model, row.data_path))
        if not row.saar or twin is None:
            continue
        saar_s, raw_s = _per_rollout(row), _per_rollout(twin)
        if saar_s is not None and raw_s:
            ratios[row.eval_id] = saar_s / raw_s
    return ratios


def _json_number(value: float) -> float | None:
    return None if missing(value) else value


def eval_records(rows: Sequence[EvalRunRow]) -> list[dict]:
    """One JSON object per row."""
    ratios = latency_ratios(rows)
    return [{
        "model": row.model, "dataset": row.dataset, "saar": row.saar, "n": row.n, "problems": row.problems,
        "rollouts": row.rollouts, "avg_at_n": row.avg_at_n,
        "pass_at_k": {str(k): value for k, value in row.pass_at_k}, "maj_at_n": row.maj_at_n,
        "tool_calls_per_trajectory": row.tool_calls_per_trajectory,
        "failures_per_trajectory": row.failures_per_trajectory,
        "first_call_error_rate": _json_number(row.first_call_error_rate),
        "recovery_rate": _json_number(row.recovery_rate), "seconds": row.seconds,
        "rollouts_generated": row.rollouts_generated, "latency_ratio": ratios.get(row.eval_id),
        "eval_id": row.eval_id, "data_source": row.data_source, "prompt_style": row.prompt_style,
        "policy_version": row.policy_version,
    } for row in rows]


def eval_scalars(row: EvalRunRow) -> tuple[str, dict[str, float]]:
    """The section and scalars a metrics logger gets for one evaluation: section
    `eval/<dataset>/<model directory name>/<saar|raw>`, values avg@n, pass@k per k, maj@n, the tool
    rates and seconds; a rate without calls (NaN in the row) is left out, as `row_metrics` does."""
    setting = "saar" if row.saar else "raw"
    section = f"eval/{row.dataset}/{Path(row.model).name or row.model}/{setting}"
    values = {"avg_at_n": row.avg_at_n, **{f"pass_at_{k}": value for k, value in row.pass_at_k},
              "maj_at_n": row.maj_at_n, "tool_calls_per_trajectory": row.tool_calls_per_trajectory,
              "failures_per_trajectory": row.failures_per_trajectory,
              "first_call_error_rate": row.first_call_error_rate, "recovery_rate": row.recovery_rate,
              "seconds": row.seconds}
    return section, {name: value for name, value in values.items() if not math.isnan(value)}


def eval_table(rows: Sequence[EvalRunRow]) -> Table:
    """The rich table of the rows; pass@k columns for every k the first row has."""
    ratios = latency_ratios(rows)
    ks = [k for k, _ in rows[0].pass_at_k] if rows else []
    n = rows[0].n if rows else 0
    table = Table(title="eval", header_style="bold")
    for name in ("model", "dataset", "saar", "problems", f"avg@{n}", *(f"pass@{k}" for k in ks), f"maj@{n}",
                 "calls/traj", "fail/traj", "1st-call err", "seconds", "latency x"):
        table.add_column(name, justify="left" if name in ("model", "dataset") else "right")
    for row in rows:
        pass_at = dict(row.pass_at_k)
        table.add_row(
            row.model, row.dataset, "on" if row.saar else "off", setting(row.problems), rate(row.avg_at_n),
            *(rate(pass_at.get(k)) for k in ks), rate(row.maj_at_n), number(row.tool_calls_per_trajectory),
            number(row.failures_per_trajectory), rate(row.first_call_error_rate), seconds(row.seconds),
            number(ratios.get(row.eval_id)),
        )
    if ratios:
        table.caption = ("latency x: seconds per generated rollout with SAAR over without, same model, "
                         "problems and seeds")
    return table


# ---------------------------------------------------------------------------------------------
# Iterations (`cleaner run`, `cleaner demo`)


ITERATION_COLUMNS = (
    ("iteration", "iter", setting),
    ("accuracy", "accuracy", rate),
    ("first_attempt_error_rate", "1st-call err", rate),
    ("failures_per_trajectory", "fail/traj", number),
    ("n_shallow", "shallow", setting),
    ("n_deep", "deep", setting),
    ("collect_s", "collect s", seconds),
    ("purify_s", "purify s", seconds),
    ("train_s", "train s", seconds),
)


def iterations_frame(rows: Sequence[IterationRow]) -> pl.DataFrame:
    """One row per iteration (the latest record wins if an iteration was logged twice)."""
    frame = pl.DataFrame([{name: getattr(r, name) for name, _, _ in ITERATION_COLUMNS} for r in rows])
    if frame.is_empty():
        return frame
    return frame.unique(subset="iteration", keep="last").sort("iteration")


def iteration_table(rows: Sequence[IterationRow], title: str = "cleaner run") -> Table:
    table = Table(title=title, header_style="bold")
    for _, header, _ in ITERATION_COLUMNS:
        table.add_column(header, justify="right")
    for record in iterations_frame(rows).iter_rows(named=True):
        table.add_row(*(formatter(record[name]) for name, _, formatter in ITERATION_COLUMNS))
    return table
