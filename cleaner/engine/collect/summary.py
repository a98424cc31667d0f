"""Headline numbers of one collection: how often calls fail, and how often the model recovers.

Computed with polars from the records the agent loop returns (no warehouse access here), so the CLI
can print them after `cleaner collect` and `cleaner run` can store them in the `iterations` table.

Definitions (docs/architecture.md §3, §5):
- a *call* is an assistant segment with a tool call (call_start set); it is *well formed* when its
  code parsed (tool_code set). Calls left unexecuted at max_turns count here but have no outcome.
- an *outcome* is a tool segment; the first-attempt error rate is the share of attempt-0 outcomes
  whose status is not ok (format, infra and timeout failures included).
- a *chain* is one (rollout, step); it has a failure if any of its outcomes failed, and it is
  *recovered* if an ok outcome comes at a later attempt than its first failure.
- retries are assistant segments with attempt >= 1 (a retry that answers instead of calling counts).
Rates with an empty denominator are NaN (shown as "-"), never a made-up 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from cleaner.records import Rollout, Segment, SegmentKind, ToolStatus


@dataclass(frozen=True)
class CollectSummary:
    rollouts: int
    accuracy: float  # share of rollouts with correct = True
    mean_reward: float
    tool_calls: int  # executed calls (tool segments)
    failed_calls: int  # tool segments whose status is not ok
    failed_calls_per_rollout: float
    well_formed_call_rate: float  # calls that parsed / calls
    first_attempt_error_rate: float  # attempt-0 outcomes not ok / attempt-0 outcomes
    failures_by_error_type: tuple[tuple[str, int], ...]  # most frequent first; status if no type
    retries: int  # assistant segments with attempt >= 1
    chains_with_failure: int
    recovered_chains: int
    recovery_rate: float  # recovered_chains / chains_with_failure
    finish_reasons: tuple[tuple[str, int], ...]  # most frequent first


# ---------------------------------------------------------------------------------------------
# Frames


def _rollout_frame(rollouts: Sequence[Rollout]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "reward": [float(r.reward) for r in rollouts],
            "correct": [bool(r.correct) for r in rollouts],
            "finish_reason": [r.finish_reason for r in rollouts],
        },
        schema={"reward": pl.Float64, "correct": pl.Boolean, "finish_reason": pl.String},
    )


def _segment_frame(segments: Sequence[Segment]) -> pl.DataFrame:
    kept = [s for s in segments if s.kind in (SegmentKind.ASSISTANT, SegmentKind.TOOL)]
    return pl.DataFrame(
        {
            "rollout_id": [s.rollout_id for s in kept],
            "kind": [s.kind for s in kept],
            "step": [s.step for s in kept],
            "attempt": [s.attempt for s in kept],
            "has_call": [s.call_start is not None for s in kept],
            "parsed": [s.tool_code is not None for s in kept],
            "tool_status": [s.tool_status for s in kept],
            "error_type": [s.error_type for s in kept],
        },
        schema={"rollout_id": pl.String, "kind": pl.String, "step": pl.Int64, "attempt": pl.Int64,
                "has_call": pl.Boolean, "parsed": pl.Boolean, "tool_status": pl.String,
                "error_type": pl.String},
    )


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else math.nan


def _counts(frame: pl.DataFrame, column: str) -> tuple[tuple[str, int], ...]:
    counted = frame.group_by(column).len().sort(["len", column], descending=[True, False])
    return tuple((str(key), int(n)) for key, n in counted.iter_rows())


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(rollouts: Sequence[Rollout], segments: Sequence[Segment]) -> CollectSummary:
    """Headline numbers of a collection (see the module docstring for the definitions)."""
    runs = _rollout_frame(rollouts)
    frame = _segment_frame(segments)
    calls = frame.filter((pl.col("kind") == SegmentKind.ASSISTANT) & pl.col("has_call"))
    outcomes = frame.filter(pl.col("kind") == SegmentKind.TOOL).with_columns(
        failed=pl.col("tool_status") != ToolStatus.OK)
    first = outcomes.filter(pl.col("attempt") == 0)
    failures = outcomes.filter("failed").with_columns(
        reason=pl.coalesce("error_type", "tool_status"))
    chains = (
        outcomes.group_by("rollout_id", "step")
        .agg(first_failure=pl.col("attempt").filter("failed").min(),
             last_ok=pl.col("attempt").filter(~pl.col("failed")).max())
        .filter(pl.col("first_failure").is_not_null())
    )
    recovered = chains.filter(pl.col("last_ok") > pl.col("first_failure")).height
    n_rollouts = runs.height
    return CollectSummary(
        rollouts=n_rollouts,
        accuracy=float(runs["correct"].mean()) if n_rollouts else math.nan,
        mean_reward=float(runs["reward"].mean()) if n_rollouts else math.nan,
        tool_calls=outcomes.height,
        failed_calls=failures.height,
        failed_calls_per_rollout=_ratio(failures.height, n_rollouts),
        well_formed_call_rate=_ratio(int(calls["parsed"].sum()), calls.height),
        first_attempt_error_rate=_ratio(int(first["failed"].sum()), first.height),
        failures_by_error_type=_counts(failures, "reason"),
        retries=frame.filter((pl.col("kind") == SegmentKind.ASSISTANT) & (pl.col("attempt") >= 1)).height,
        chains_with_failure=chains.height,
        recovered_chains=recovered,
        recovery_rate=_ratio(recovered, chains.height),
        finish_reasons=_counts(runs, "finish_reason"),
    )
