"""Comparison tables of purify configs (one row per config), built with polars.

Beyond SAAR's own counters, each config reports the tokens it trains and how many of them are
`ctx-rewritten`: loss tokens whose recomputed old log-prob differs from the behaviour log-prob
(|diff| > 1e-3), i.e. tokens whose context purification rewrote after they were sampled. That is
the off-policy share a config creates, which truncated IS (docs/architecture.md §6) can correct.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import polars as pl
from rich.table import Table

from cleaner.engine.saar.premise import PremiseStats

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
            "trained": trained,
            "rewritten": rewritten,
        })
    return pl.DataFrame(records)


def _cell(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


PARAMETERS = ("gamma", "p", "sim", "when", "tau", "neg", "edit")
# Counters shown only when some config sets their parameter off its default (parameter, default).
OPTIONAL = {"gated": ("tau", 0.0), "negatives": ("neg", False), "masked": ("edit", "replace")}


def stats_table(results: Sequence, title: str = "purify") -> Table:
    """The comparison table; of the parameters, only those that vary across configs are shown."""
    frame = stats_frame(results)
    if frame.is_empty():
        return Table(title=title)
    unused = [counter for counter, (parameter, default) in OPTIONAL.items() if (frame[parameter] == default).all()]
    unset = [OPTIONAL[counter][0] for counter in unused]  # their parameters are at the default everywhere
    constant = [name for name in PARAMETERS if name not in unset and frame[name].n_unique() == 1 and frame.height > 1]
    facts = [f"{frame['rollouts'][0]} rollouts"] + [f"{name} {_cell(frame[name][0])}" for name in constant]
    title += " (" + ", ".join(facts) + ")"
    frame = frame.drop([*constant, *unset, *unused, "rollouts"]).with_columns(pl.col("config_id").str.slice(0, 8))
    table = Table(title=title, header_style="bold")
    for name in frame.columns:
        table.add_column(name, justify="left" if frame[name].dtype == pl.String else "right", no_wrap=True)
    for record in frame.iter_rows():
        table.add_row(*(_cell(v) for v in record))
    errors = results[0].stats.errors_by_type if results else ()
    if errors:
        table.caption = "failed calls in the input: " + ", ".join(f"{name} {count}" for name, count in errors)
    return table


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def premise_table(premise: PremiseStats, title: str = "premise") -> Table:
    """Clean, recovered and unrecovered rollouts: how many, how accurate, their mean advantage.

    Read first when deciding whether CLEANER can help on a dataset (cleaner.engine.saar.premise)."""
    table = Table(title=title, header_style="bold")
    for name in ("rollouts", "count", "accuracy", "mean advantage"):
        table.add_column(name, justify="left" if name == "rollouts" else "right")
    for name in ("clean", "recovered", "unrecovered"):
        stats = getattr(premise, name)
        advantage = "-" if stats.mean_advantage is None else f"{stats.mean_advantage:+.3f}"
        table.add_row(name, str(stats.rollouts), _rate(stats.accuracy), advantage)
    ratio = premise.recovered_over_clean
    credit = premise.credit
    if credit.tokens:
        table.add_section()
        table.add_row("failed-call tokens", str(credit.tokens), f"{credit.positive_share:.1%} in +adv",
                      f"{credit.mean_advantage:+.3f}")
    table.caption = ("recovered / clean accuracy " + ("-" if math.isnan(ratio) else f"{ratio:.2f}")
                     + ": near 1, failed calls do not predict a wrong answer and purifying removes noise "
                       "the reward cannot see; well below 1, the reward already punishes them")
    if credit.tokens:
        table.caption += ("; failed-call tokens (raw view): their mean advantage is the credit GRPO gives "
                          "failed calls, positive = reinforced (the paper's premise), negative = already pushed down")
    return table
