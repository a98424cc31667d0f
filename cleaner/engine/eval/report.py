"""What `cleaner eval` prints: one table, or a JSON list, over the evaluations' rows.

Design decisions:
- One row per (model, dataset, SAAR setting). When both settings of a (model, dataset) ran, the
  SAAR row carries the latency ratio: its seconds per generated rollout over the raw setting's
  (plan.py says why per generated rollout); the paper reports SAAR's test-time cost as this ratio.
- JSON holds every metric with `pass_at_k` as an object keyed by k; a rate with an empty
  denominator (NaN in the warehouse) is null, so the output is strict JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from cleaner.records import EvalRunRow


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


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def eval_records(rows: Sequence[EvalRunRow]) -> list[dict]:
    """One JSON object per row."""
    ratios = latency_ratios(rows)
    return [{
        "model": row.model, "dataset": row.dataset, "saar": row.saar, "n": row.n, "problems": row.problems,
        "rollouts": row.rollouts, "avg_at_n": row.avg_at_n,
        "pass_at_k": {str(k): value for k, value in row.pass_at_k}, "maj_at_n": row.maj_at_n,
        "tool_calls_per_trajectory": row.tool_calls_per_trajectory,
        "failures_per_trajectory": row.failures_per_trajectory,
        "first_call_error_rate": _number(row.first_call_error_rate),
        "recovery_rate": _number(row.recovery_rate), "seconds": row.seconds,
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


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


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
        ratio = ratios.get(row.eval_id)
        table.add_row(
            row.model, row.dataset, "on" if row.saar else "off", str(row.problems), f"{row.avg_at_n:.3f}",
            *(f"{pass_at[k]:.3f}" if k in pass_at else "-" for k in ks), f"{row.maj_at_n:.3f}",
            f"{row.tool_calls_per_trajectory:.2f}", f"{row.failures_per_trajectory:.3f}",
            _rate(row.first_call_error_rate), f"{row.seconds:.1f}", "-" if ratio is None else f"{ratio:.3f}",
        )
    if ratios:
        table.caption = ("latency x: seconds per generated rollout with SAAR over without, same model, "
                         "problems and seeds")
    return table
