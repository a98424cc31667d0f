# %% [markdown]
# # Explore a warehouse (read-only)
#
# Run as a script, `python notebooks/explore_warehouse.py WAREHOUSE`, or cell by cell in an editor
# that understands `# %%` (VS Code, Jupytext). It opens the warehouse through
# `Warehouse(root).connect()` (an in-memory DuckDB over the Parquet parts: nothing is written) and
# prints, with polars:
#
# 1. accuracy and tool-failure rates per iteration,
# 2. error types per iteration,
# 3. recovery by attempt: how often the k-th try at a step succeeds,
# 4. shallow vs deep merges per purify config.
#
# SQL only selects the columns; the tabulation is polars, so each table is a few lines to change.

# %%
from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from cleaner.warehouse import Warehouse, WarehouseError


def frame(connection, query: str) -> pl.DataFrame:
    """A DuckDB query as a polars frame."""
    return pl.from_arrow(connection.sql(query).to_arrow_table())


def section(title: str, table: pl.DataFrame) -> None:
    print(f"\n## {title}")
    print(table if table.height else "(no rows)")


def open_warehouse(argv: list[str]):
    root = Path(argv[1]) if len(argv) > 1 else Path("warehouse")
    print(f"warehouse: {root}")
    return Warehouse(root).connect()


# %% [markdown]
# ## 1. Accuracy and tool failures per iteration
# `failed_call_rate` is failed calls over all calls; `first_call_error_rate` is the share of steps
# whose first attempt failed (the rate SAAR has to clean up).


# %%
def accuracy_by_iteration(connection) -> pl.DataFrame:
    rollouts = frame(connection, "SELECT iteration, correct, n_tool_calls, n_failed_calls FROM rollouts")
    first_calls = frame(connection, "SELECT iteration, tool_status FROM attempts WHERE has_call AND attempt = 0")
    per_rollout = rollouts.group_by("iteration").agg(
        pl.len().alias("rollouts"),
        pl.col("correct").cast(pl.Float64).mean().alias("accuracy"),
        pl.col("n_failed_calls").cast(pl.Float64).mean().alias("failures_per_rollout"),
        (pl.col("n_failed_calls").sum() / pl.col("n_tool_calls").sum()).alias("failed_call_rate"),
    )
    first = first_calls.group_by("iteration").agg(
        (pl.col("tool_status") != "ok").cast(pl.Float64).mean().alias("first_call_error_rate"))
    return per_rollout.join(first, on="iteration", how="left").sort("iteration")


# %% [markdown]
# ## 2. Error types
# A tool failure's `error_type` is the exception name; timeouts and format errors have none, so
# their `tool_status` stands in.


# %%
def error_types(connection) -> pl.DataFrame:
    failures = frame(connection, "SELECT iteration, tool_status, error_type FROM failures")
    return (
        failures.with_columns(pl.coalesce("error_type", "tool_status").alias("error"))
        .group_by("iteration", "error").agg(pl.len().alias("count"))
        .with_columns((pl.col("count") / pl.col("count").sum().over("iteration")).alias("share"))
        .sort(["iteration", "count", "error"], descending=[False, True, False])
    )


# %% [markdown]
# ## 3. Recovery by attempt
# For each attempt number k (0 = first try), how many calls were made and how many succeeded.
# `answered` counts retries that gave an answer instead of calling again.


# %%
def recovery_by_attempt(connection) -> pl.DataFrame:
    attempts = frame(connection, "SELECT iteration, attempt, has_call, tool_status FROM attempts")
    return (
        attempts.group_by("iteration", "attempt").agg(
            pl.col("has_call").sum().alias("calls"),
            ((pl.col("tool_status") == "ok") & pl.col("has_call")).sum().alias("succeeded"),
            (~pl.col("has_call") & (pl.col("attempt") > 0)).sum().alias("answered"),
        )
        .with_columns((pl.col("succeeded") / pl.col("calls")).alias("success_rate"))
        .sort("iteration", "attempt")
    )


# %% [markdown]
# ## 4. Shallow vs deep per purify config
# One row per (iteration, config): merges, unrecovered chains and tokens removed, summed over the
# iteration's rows, with the config's parameters.


# %%
def merges_by_config(connection) -> pl.DataFrame:
    rows = frame(connection, "SELECT iteration, config_id, rolled_back, n_shallow, n_deep, n_unrecovered, "
                             "tokens_removed FROM purified")
    configs = frame(connection, "SELECT config_id, gamma, rollback_prob, similarity_on, purify_when "
                                "FROM purify_configs").unique("config_id")
    totals = rows.group_by("iteration", "config_id").agg(
        pl.len().alias("rows"),
        pl.col("rolled_back").sum().alias("rolled_back"),
        pl.col("n_shallow").sum().alias("shallow"),
        pl.col("n_deep").sum().alias("deep"),
        pl.col("n_unrecovered").sum().alias("unrecovered"),
        pl.col("tokens_removed").sum().alias("tokens_removed"),
    )
    return (
        totals.join(configs, on="config_id", how="left")
        .with_columns((pl.col("shallow") / (pl.col("shallow") + pl.col("deep"))).alias("shallow_share"))
        .sort("iteration", "gamma", "rollback_prob", "config_id")
    )


# %%
def main(argv: list[str]) -> None:
    try:
        connection = open_warehouse(argv)
    except WarehouseError as exc:
        sys.exit(f"error: {exc}")
    with pl.Config(tbl_rows=50, tbl_cols=20, tbl_width_chars=200, float_precision=3):
        section("accuracy and tool failures per iteration", accuracy_by_iteration(connection))
        section("error types", error_types(connection))
        section("recovery by attempt", recovery_by_attempt(connection))
        section("shallow vs deep per purify config", merges_by_config(connection))


if __name__ == "__main__":
    main(sys.argv)
