"""GRPO group-normalised advantages (docs/architecture.md §7), computed with polars.

advantage_i = (r_i - mean_group) / (std_group + eps)

Design decisions:
- std is the SAMPLE standard deviation (ddof = 1), as verl's GRPO estimator (`torch.std`) computes
  it; the paper trains with verl.
- A group of one, or a group whose rewards are all equal, gets advantage exactly 0 for every member
  (no signal). verl instead gives a lone sample r / (1 + eps); we do not, so that a lone sample never
  pushes the policy. Equality is tested as max == min, so float noise in the mean cannot leak a
  tiny non-zero advantage.
- Rows with `counted` False (rollouts an infrastructure fault ended: their reward says nothing
  about the policy) get advantage 0 and are left out of their group's mean, std and size, as
  open-instruct masks infra-failed completions.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl


def grpo_advantages(group_ids: Sequence[str], rewards: Sequence[float], eps: float,
                    counted: Sequence[bool] | None = None) -> list[float]:
    """Per-rollout advantages, aligned with the inputs; rows not `counted` get 0 and no say."""
    if len(group_ids) != len(rewards):
        raise ValueError(f"{len(group_ids)} group ids for {len(rewards)} rewards")
    if counted is not None and len(counted) != len(rewards):
        raise ValueError(f"{len(counted)} counted flags for {len(rewards)} rewards")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not rewards:
        return []
    frame = pl.DataFrame(
        {"group_id": list(group_ids), "reward": [float(r) for r in rewards],
         "counted": [True] * len(rewards) if counted is None else [bool(c) for c in counted]},
        schema={"group_id": pl.String, "reward": pl.Float64, "counted": pl.Boolean},
    )
    member = pl.col("counted")
    reward = pl.col("reward").filter(member)  # the group's statistics see counted rows only
    degenerate = ~member | (member.sum().over("group_id") <= 1) | (
        reward.max().over("group_id") == reward.min().over("group_id")
    )
    normalised = (pl.col("reward") - reward.mean().over("group_id")) / (
        reward.std(ddof=1).over("group_id") + eps
    )
    advantage = pl.when(degenerate).then(0.0).otherwise(normalised)
    return frame.select(advantage.alias("advantage"))["advantage"].to_list()
