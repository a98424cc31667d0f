"""What `cleaner curate` reads (docs/architecture.md §16): each prompt's rollouts over some collected
iterations and evaluations, pooled, in one DuckDB query over `Warehouse.connect()`'s views.

A rollout an infrastructure fault ended is counted apart and in none of the other sums: its
generation failed (finish_reason `error`), or one of its calls still failed with `infra_error` after
the sandbox's retries, the rule purify applies (`engine/purify/pipeline.py`, `infra_fault`).
Successes are the rollouts graded correct, rewards summed over the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import duckdb

PASS_RATES = """
    WITH picked AS (
        SELECT rollout_id, prompt_id, data_source, correct, reward, finish_reason FROM rollouts
        WHERE list_contains($iterations, iteration)
        UNION ALL
        SELECT rollout_id, prompt_id, data_source, correct, reward, finish_reason FROM eval_rollouts
        WHERE list_contains($evals, collect_config_id)),
    tool_faults AS (
        SELECT DISTINCT rollout_id FROM segments WHERE kind = 'tool' AND tool_status = 'infra_error'
            AND list_contains($iterations, iteration)
        UNION
        SELECT DISTINCT s.rollout_id FROM eval_segments s SEMI JOIN picked p ON s.rollout_id = p.rollout_id
        WHERE s.kind = 'tool' AND s.tool_status = 'infra_error'),
    marked AS (
        SELECT p.*, p.finish_reason = 'error' OR f.rollout_id IS NOT NULL AS faulted
        FROM picked p LEFT JOIN tool_faults f USING (rollout_id))
    SELECT prompt_id, data_source, count(*) AS rollouts,
           count(*) FILTER (WHERE faulted) AS faults,
           count(*) FILTER (WHERE NOT faulted AND correct) AS successes,
           coalesce(sum(reward::DOUBLE) FILTER (WHERE NOT faulted), 0) AS reward_sum
    FROM marked GROUP BY prompt_id, data_source ORDER BY prompt_id, data_source"""


@dataclass(frozen=True)
class PromptOutcomes:
    """One prompt's rollouts over the iterations and evaluations read."""

    prompt_id: str
    data_source: str
    rollouts: int  # every rollout of the prompt read
    faults: int  # of those, the ones an infrastructure fault ended
    successes: int  # correct rollouts among the rest
    reward_sum: float  # their rewards' sum

    @property
    def attempts(self) -> int:
        """The rollouts the policy decided."""
        return self.rollouts - self.faults


def prompt_outcomes(connection: duckdb.DuckDBPyConnection, iterations: Sequence[int],
                    eval_ids: Sequence[str]) -> list[PromptOutcomes]:
    """Each prompt's outcomes pooled over `iterations` (of `rollouts`) and `eval_ids` (of `eval_rollouts`)."""
    rows = connection.execute(PASS_RATES, {"iterations": [int(i) for i in iterations],
                                           "evals": [str(e) for e in eval_ids]}).fetchall()
    return [PromptOutcomes(*row) for row in rows]
