"""Advantages from a group's rewards, named and computed as verl's estimators (`adv_estimator`,
docs/architecture.md §7): the group statistics with polars, the batch-wide whitening with numpy.

    grpo                           (r - mean_group) / (std_group + eps); norm_adv_by_std off: r - mean_group (Dr.GRPO)
    rloo                           (r - mean_group) * n / (n - 1): r minus the mean of the group's other rewards
    reinforce_plus_plus_baseline   r - mean_group, then whitened over the iteration's loss tokens (verl's masked_whiten)

Design decisions:
- std is the SAMPLE standard deviation (ddof = 1), as verl's GRPO estimator (`torch.std`) computes
  it; the paper trains with verl.
- A group of one, or a group whose rewards are all equal, gets advantage exactly 0 for every member
  under every estimator (no signal). verl instead gives a lone sample r / (1 + eps) (GRPO) or r (the
  others); we do not, so that a lone sample never pushes the policy. Equality is tested as max ==
  min, so float noise in the mean cannot leak a tiny non-zero advantage.
- Rows with `counted` False (rollouts an infrastructure fault ended: their reward says nothing
  about the policy) get advantage 0 and are left out of their group's mean, std and size, and out
  of the whitening, as open-instruct masks infra-failed completions.
- Whitening (reinforce_plus_plus_baseline) is verl's masked_whiten of each row's centred score
  repeated on its loss tokens: the token-weighted mean and the Bessel-corrected variance over every
  loss token of the batch (verl's 1e-8 in the mean's denominator and under the square root). A
  group without signal takes part with its score 0, as an equal-reward group does in verl, and
  keeps advantage 0 after; a row without loss tokens has no say and its value trains nothing (verl
  multiplies it by the response mask). With fewer than two loss tokens in the batch there is no
  variance (verl raises): every advantage is 0. The batch is what one purify sees: the whole iteration, which a
  shard (`--shard`) does not, so purify refuses that estimator on a shard.
- The sign of the group stage decides `purify_when = positive` (reward above the group's mean) for
  every estimator, before the rows are rendered; the whitening needs the rendered loss masks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from cleaner.config import AdvEstimator, PurifyConfig

WHITEN_EPS = 1e-8  # verl's masked_mean denominator and masked_whiten's variance floor


# ---------------------------------------------------------------------------
# The group stage


def _grpo(centred: pl.Expr, std: pl.Expr, size: pl.Expr, config: PurifyConfig) -> pl.Expr:
    return centred / (std + config.advantage_eps) if config.norm_adv_by_std else centred


def _rloo(centred: pl.Expr, std: pl.Expr, size: pl.Expr, config: PurifyConfig) -> pl.Expr:
    return centred * size / (size - 1)


def _centred(centred: pl.Expr, std: pl.Expr, size: pl.Expr, config: PurifyConfig) -> pl.Expr:
    return centred


GROUP_STAGE: dict[AdvEstimator, Callable[[pl.Expr, pl.Expr, pl.Expr, PurifyConfig], pl.Expr]] = {
    AdvEstimator.GRPO: _grpo,
    AdvEstimator.RLOO: _rloo,
    AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE: _centred,
}


def _check_inputs(group_ids: Sequence[str], rewards: Sequence[float], counted: Sequence[bool] | None) -> None:
    if len(group_ids) != len(rewards):
        raise ValueError(f"{len(group_ids)} group ids for {len(rewards)} rewards")
    if counted is not None and len(counted) != len(rewards):
        raise ValueError(f"{len(counted)} counted flags for {len(rewards)} rewards")


@dataclass(frozen=True)
class GroupStage:
    """The group stage of an estimator, per row: its advantage (grpo's and rloo's final one,
    reinforce_plus_plus_baseline's before whitening) and whether its group has a signal."""

    advantages: list[float]  # 0 where there is no signal
    signal: list[bool]  # counted, in a group of at least two counted rows whose rewards differ


def group_stage(config: PurifyConfig, group_ids: Sequence[str], rewards: Sequence[float],
                counted: Sequence[bool] | None = None) -> GroupStage:
    """The estimator's group stage over rows aligned with the inputs; rows not `counted` get 0 and
    no say, a group without signal 0."""
    _check_inputs(group_ids, rewards, counted)
    if not rewards:
        return GroupStage([], [])
    frame = pl.DataFrame(
        {"group_id": list(group_ids), "reward": [float(r) for r in rewards],
         "counted": [True] * len(rewards) if counted is None else [bool(c) for c in counted]},
        schema={"group_id": pl.String, "reward": pl.Float64, "counted": pl.Boolean},
    )
    member = pl.col("counted")
    reward = pl.col("reward").filter(member)  # the group's statistics see counted rows only
    size = member.sum().over("group_id").cast(pl.Float64)
    signal = member & (reward.max().over("group_id") != reward.min().over("group_id"))  # a lone row: max == min
    centred = pl.col("reward") - reward.mean().over("group_id")
    value = GROUP_STAGE[config.adv_estimator](centred, reward.std(ddof=1).over("group_id"), size, config)
    result = frame.select(pl.when(signal).then(value).otherwise(0.0).alias("advantage"), signal.alias("signal"))
    return GroupStage(result["advantage"].to_list(), result["signal"].to_list())


def group_advantages(config: PurifyConfig, group_ids: Sequence[str], rewards: Sequence[float],
                     counted: Sequence[bool] | None = None) -> list[float]:
    """`group_stage`'s advantages."""
    return group_stage(config, group_ids, rewards, counted).advantages


def grpo_advantages(group_ids: Sequence[str], rewards: Sequence[float], eps: float,
                    counted: Sequence[bool] | None = None) -> list[float]:
    """GRPO's advantages with the group's std and `eps` (`group_advantages` of such a config, which
    refuses an eps <= 0)."""
    return group_advantages(PurifyConfig(advantage_eps=eps), group_ids, rewards, counted)


# ---------------------------------------------------------------------------
# The batch stage


def whitened(stage: GroupStage, loss_tokens: Sequence[int], counted: Sequence[bool]) -> list[float]:
    """verl's masked_whiten of each row's group-stage value over its `loss_tokens`, over the rows
    `counted`; a row without signal gets 0 (module notes)."""
    value = np.asarray(stage.advantages, dtype=np.float64)  # (B,)
    tokens = np.asarray(loss_tokens, dtype=np.float64) * np.asarray(counted, dtype=bool)  # (B,)
    total = tokens.sum()
    if total < 2:
        return [0.0] * len(value)
    mean = (tokens * value).sum() / (total + WHITEN_EPS)
    variance = (tokens * (value - mean) ** 2).sum() / (total + WHITEN_EPS) * total / (total - 1)
    result = (value - mean) / np.sqrt(variance + WHITEN_EPS)
    return np.where(np.asarray(stage.signal, dtype=bool), result, 0.0).tolist()


def advantages(config: PurifyConfig, group_ids: Sequence[str], rewards: Sequence[float],
               loss_tokens: Sequence[int], counted: Sequence[bool] | None = None) -> list[float]:
    """The estimator's final advantages of rows whose loss tokens are known (train's overlong
    shaping recomputes them so): the group stage, then the whitening where the estimator has one."""
    stage = group_stage(config, group_ids, rewards, counted)
    if not config.whole_batch:
        return stage.advantages
    return whitened(stage, loss_tokens, [True] * len(stage.advantages) if counted is None else counted)
