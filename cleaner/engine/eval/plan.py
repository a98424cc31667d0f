"""What `cleaner eval` runs, and the row each evaluation leaves (docs/architecture.md §12).

Design decisions:
- One evaluation = one model on one dataset under one SAAR setting, run as one collect config at
  iteration 0 with n samples per problem. The config's id is the evaluation's id: it names the
  warehouse partition of its rollouts and segments, prefixes their rollout ids (so `cleaner show`
  finds each one uniquely) and is their `collect_config_id` (so SQL joins `eval_runs` to them).
  Running the same evaluation again therefore finds its committed rollouts and continues. A
  complete evaluation an earlier version stored under another id (format 1, warehouse/format.py) is
  found through its stored config (`stored_evaluation`) and not run again.
- Seeds derive from the prompt id and sample index, not from the evaluation, so the SAAR and raw
  settings sample the same first turn of every rollout: the two differ only after a failed call.
- `seconds` is the wall time of the session that completed the evaluation and `rollouts_generated`
  what it generated; the latency ratio (cleaner/report/tables.py) compares seconds per generated rollout, so a
  resumed evaluation does not look faster than it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.config import CollectConfig, EvalConfig
from cleaner.engine.collect.datasets import LoadedDataset
from cleaner.engine.eval.metrics import EvalMetrics
from cleaner.records import CollectView, EvalRunRow


@dataclass(frozen=True)
class EvalPlan:
    model: str
    dataset: str  # the name given on the command line
    data: LoadedDataset
    collect_config: CollectConfig
    stored_id: str | None = None  # the id an earlier version stored this evaluation under, if it did

    @property
    def eval_id(self) -> str:
        return self.stored_id or self.collect_config.config_id

    @property
    def saar(self) -> bool:
        return self.collect_config.collect_view == CollectView.PURIFIED

    @property
    def rollout_prefix(self) -> str:
        return f"eval-{self.eval_id}-"


def eval_plans(config: EvalConfig, datasets: Sequence[tuple[str, LoadedDataset]]) -> list[EvalPlan]:
    """Every (model, dataset, SAAR setting) in that nesting order; `datasets` pairs each name with
    its loaded file, in the order of `config.datasets`."""
    paths = dict(config.datasets)
    return [
        EvalPlan(model, name, data, config.collect_config(model, paths[name], saar, len(data.tasks)))
        for model in config.models for name, data in datasets for saar in config.saar
    ]


def eval_run_row(plan: EvalPlan, metrics: EvalMetrics, policy_version: str, seconds: float,
                 rollouts_generated: int) -> EvalRunRow:
    """The `eval_runs` row of a completed evaluation."""
    config = plan.collect_config
    return EvalRunRow(
        eval_id=plan.eval_id, model=plan.model, policy_version=policy_version, dataset=plan.dataset,
        data_path=str(config.data), data_source=",".join(sorted({t.data_source for t in plan.data.tasks})),
        prompt_style=str(config.prompt_style), saar=plan.saar, n=metrics.n, problems=metrics.problems,
        rollouts=metrics.rollouts, avg_at_n=metrics.avg_at_n, pass_at_k=metrics.pass_at_k,
        maj_at_n=metrics.maj_at_n, tool_calls_per_trajectory=metrics.tool_calls_per_trajectory,
        failures_per_trajectory=metrics.failures_per_trajectory,
        first_call_error_rate=metrics.first_call_error_rate, recovery_rate=metrics.recovery_rate,
        seconds=seconds, rollouts_generated=rollouts_generated, seed=config.seed,
        temperature=config.temperature, top_p=config.top_p, max_turns=config.max_turns,
        config_json=config.to_json(),
    )
