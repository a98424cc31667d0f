"""The read-only queries behind `cleaner report` (docs/architecture.md §13), and the one collection
reads to skip settled prompts (§5), over `Warehouse.connect()`.

Each query returns a polars frame with the columns the figures plot, so the SQL (and every column
name of the datasets) stays in the warehouse layer and the figures never see a table.

Design decisions:
- The per-iteration curves come from `iterations`, the run's own record: they are the numbers
  `cleaner run` printed, and a warehouse without that table (collect or ablate only) has no run
  to plot. An iteration logged twice keeps its latest row, as `cleaner run`'s table does.
- An ablation's configs carry their edit (replace or mask; a config stored before edits existed
  reads as replace).
- Error types come from the `failures` view, so they exist for any collected warehouse. A failure
  without an exception name (timeout, format error) is counted under its status.
- An *ablation* is an iteration purified under two or more configs; `cleaner run` purifies one
  config per iteration, so its iterations are never one. Negative samples are counted apart and
  left out of every other count, which are per rollout.
- Eval results are read from the `eval_runs` view (what `cleaner eval` writes): `model`,
  `dataset`, `saar` (shown as text), `avg_at_n`, `pass_at_k` (a map, shown as text) and
  `failures_per_trajectory`. A warehouse without evaluations gives None.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import polars as pl


def _frame(connection: duckdb.DuckDBPyConnection, query: str) -> pl.DataFrame:
    return pl.from_arrow(connection.sql(query).to_arrow_table())


def iteration_curves(connection: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per completed iteration: headline metrics, merges and the premise diagnostic, with
    the credit of failed calls (null in rows written before it was stored)."""
    return _frame(connection, """
        SELECT iteration, accuracy, first_attempt_error_rate, failures_per_trajectory,
               n_shallow, n_deep, n_gated,
               clean_rollouts, clean_accuracy, recovered_rollouts, recovered_accuracy,
               unrecovered_rollouts, unrecovered_accuracy, recovered_advantage,
               failed_call_advantage, failed_call_positive_share
        FROM iterations
        QUALIFY row_number() OVER (PARTITION BY iteration ORDER BY created_at DESC) = 1
        ORDER BY iteration
    """)


def train_curves(connection: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per optimiser step, in run order."""
    return _frame(connection, """
        SELECT iteration, step, optimizer_step, loss, clip_fraction, approx_kl, entropy, grad_norm, lr
        FROM train_steps ORDER BY optimizer_step, iteration, step
    """)


def error_types(connection: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Failed calls per (iteration, error), and per rollout of that iteration."""
    return _frame(connection, """
        WITH sizes AS (SELECT iteration, count(*) AS rollouts FROM rollouts GROUP BY iteration)
        SELECT f.iteration, coalesce(f.error_type, f.tool_status) AS error, count(*) AS failures,
               count(*) / any_value(s.rollouts) AS per_rollout
        FROM failures f JOIN sizes s USING (iteration)
        GROUP BY f.iteration, error
        ORDER BY f.iteration, failures DESC, error
    """)


def ablation_grid(connection: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Per (iteration, config) of every iteration purified under two or more configs: the config's
    parameters and what it did to the iteration's rollouts."""
    return _frame(connection, """
        WITH grid AS (
            SELECT iteration FROM purified GROUP BY iteration HAVING count(DISTINCT config_id) >= 2),
        configs AS (SELECT * FROM purify_configs QUALIFY row_number() OVER (PARTITION BY config_id) = 1)
        SELECT p.iteration, p.config_id, c.gamma, c.rollback_prob, c.similarity_on, c.purify_when, c.edit,
               TRY_CAST(json_extract_string(c.params_json, '$.rollback_is_threshold') AS DOUBLE)
                   AS is_threshold,
               coalesce(json_extract_string(c.params_json, '$.negative_samples') = 'true', false)
                   AS negative_samples,
               count(*) FILTER (WHERE p.negative_seq IS NULL) AS rollouts,
               count(*) FILTER (WHERE p.negative_seq IS NULL AND p.rolled_back) AS rolled_back,
               coalesce(sum(p.n_shallow) FILTER (WHERE p.negative_seq IS NULL), 0)::BIGINT AS shallow,
               coalesce(sum(p.n_deep) FILTER (WHERE p.negative_seq IS NULL), 0)::BIGINT AS deep,
               coalesce(sum(p.n_gated) FILTER (WHERE p.negative_seq IS NULL), 0)::BIGINT AS gated,
               coalesce(sum(p.n_unrecovered) FILTER (WHERE p.negative_seq IS NULL), 0)::BIGINT AS unrecovered,
               coalesce(sum(p.tokens_removed) FILTER (WHERE p.negative_seq IS NULL), 0)::BIGINT AS tokens_removed,
               count(*) FILTER (WHERE p.negative_seq IS NOT NULL) AS negatives
        FROM purified p JOIN grid USING (iteration) LEFT JOIN configs c USING (config_id)
        GROUP BY ALL
        ORDER BY p.iteration, c.gamma, c.rollback_prob, is_threshold, c.edit DESC, p.config_id
    """)


def eval_results(connection: duckdb.DuckDBPyConnection) -> pl.DataFrame | None:
    """The `eval_runs` view as text and numbers (module docstring), or None without rows."""
    frame = _frame(connection, """
        SELECT CAST(model AS VARCHAR) AS model, CAST(dataset AS VARCHAR) AS dataset,
               CAST(saar AS VARCHAR) AS saar, CAST(avg_at_n AS DOUBLE) AS avg_at_n,
               CAST(pass_at_k AS VARCHAR) AS pass_at_k,
               CAST(failures_per_trajectory AS DOUBLE) AS failures_per_trajectory
        FROM eval_runs ORDER BY dataset, model, saar
    """)
    return frame if frame.height else None


@dataclass(frozen=True)
class Counts:
    rollouts: int
    iterations_collected: int  # distinct iterations with rollouts


def counts(connection: duckdb.DuckDBPyConnection) -> Counts:
    ((rollouts, collected),) = connection.sql(
        "SELECT count(*), count(DISTINCT iteration) FROM rollouts").fetchall()
    return Counts(rollouts, collected)


# ---------------------------------------------------------------------------------------------
# Collection's own reads (cleaner.engine.collect.job: prompts skipped during a run)


@dataclass(frozen=True)
class LastGroup:
    """The latest group a prompt was collected in, before some iteration."""

    iteration: int
    settled: bool  # its rewards were all equal (all correct or all wrong): no advantage to learn from


def last_groups(connection: duckdb.DuckDBPyConnection, before: int) -> dict[str, LastGroup]:
    """Each prompt's latest group collected before iteration `before`, and whether it was settled.
    A rollout an infrastructure fault decided has no say (it is out of its group's advantages too):
    one whose generation failed, or that holds a call the sandbox or a tool's service failed."""
    rows = connection.execute("""
        WITH faulted AS (SELECT DISTINCT rollout_id FROM segments
                         WHERE iteration < $before AND kind = 'tool' AND tool_status = 'infra_error'),
        groups AS (SELECT prompt_id, iteration, min(reward) = max(reward) AS settled FROM rollouts
                   WHERE iteration < $before AND finish_reason <> 'error'
                     AND rollout_id NOT IN (SELECT rollout_id FROM faulted)
                   GROUP BY prompt_id, iteration)
        SELECT prompt_id, arg_max(iteration, iteration), arg_max(settled, iteration) FROM groups GROUP BY prompt_id
    """, {"before": before}).fetchall()
    return {prompt_id: LastGroup(iteration, settled) for prompt_id, iteration, settled in rows}
