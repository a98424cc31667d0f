"""Rollout correction as verl computes it (`verl/trainer/ppo/rollout_corr_helper.py`, v0.7.0: the
version the reference ships): the mismatch between the policy that sampled a rollout (its
behaviour log-probs) and the policy that trains on it (the old log-probs the scorer recomputed),
measured, and optionally corrected by truncated importance weights and rejection sampling
(docs/architecture.md §7).

Design decisions, verl's unless said:
- Per loss token, log_ratio = log pi_old - log pi_behaviour. IS weights (`rollout_is`): token level
  exp(clamp(log_ratio, +-20)); sequence level exp(clamp(sum of the row's log_ratio, +-20)) on every token of it.
  Their metrics are taken before truncation; then each is truncated at `rollout_is_threshold`
  (above only) and, with `rollout_is_batch_normalize`, divided by their mean (over tokens; over
  rows at sequence level). The weights multiply each token's clipped surrogate. Here they multiply
  the token's advantage instead, which is the same for any weight >= 0: the clipped surrogate,
  dual clip included, is positively homogeneous in the advantage (max(w a, w b) = w max(a, b)).
- Rejection sampling (`rollout_rs`): a ratio exp(clamp(.)) of log_ratio per token (`token`), of its sum
  (`sequence`) or of its mean (`geometric`), kept within [lower, upper] (`rollout_rs_threshold`,
  `rollout_rs_threshold_lower`, which defaults to 1 / upper): a rejected token (token level) or
  row (sequence, geometric) leaves the loss mask. `rollout_token_veto_threshold` rejects a whole
  row with any token whose unclamped ratio is below it. A row left with no loss token is not
  trained.
- Metrics (`rollout_corr/...` in verl's names) are computed on every iteration, correction on or
  off, over the rows trained: perplexities of both policies and their differences, k1 and k3 KL
  estimates, chi-squared, and the IS and RS statistics when those are on.
- The reference's note holds here too: CLEANER's purified rows splice tokens sampled under other
  contexts, so their ratio measures the rewrite as much as the engine's numerics; leave
  `rollout_is` off for CLEANER (as its scripts do), on for baselines if wanted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from cleaner.config import TrainConfig
from cleaner.records import PurifiedRow

SAFETY_BOUND = 20.0  # verl's clamp of a log-ratio before exp


@dataclasses.dataclass(frozen=True)
class Corrected:
    """The rows to train (rejected tokens out of their masks, IS weights in their advantages) and
    the iteration's rollout-correction metrics."""

    rows: list[PurifiedRow]
    metrics: dict[str, float]


def _log_ratios(row: PurifiedRow) -> tuple[np.ndarray, np.ndarray]:
    """(loss positions, log_ratio = old - behaviour at them) of a row."""
    mask = np.fromiter(row.loss_mask, dtype=np.int8, count=len(row.loss_mask)) > 0
    positions = np.flatnonzero(mask)
    old = np.asarray(row.old_logprobs, dtype=np.float64)[positions]
    behaviour = np.asarray(row.behavior_logprobs, dtype=np.float64)[positions]
    return positions, old - behaviour


def offpolicy_metrics(ratios: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics` over rows' log-ratios log_ratio (old - behaviour) and old log-probs."""
    rows = [(log_ratio, o) for log_ratio, o in zip(ratios, old, strict=True) if len(log_ratio)]
    if not rows:
        return {}
    every = np.concatenate([log_ratio for log_ratio, _ in rows])
    behaviour_mean = np.array([(o - log_ratio).mean() for log_ratio, o in rows])  # masked mean of the rollout's log-probs
    old_mean = np.array([o.mean() for _, o in rows])
    difference = behaviour_mean - old_mean
    clamped = np.clip(every, -SAFETY_BOUND, SAFETY_BOUND)
    sums = np.clip([log_ratio.sum() for log_ratio, _ in rows], -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(np.exp(-old_mean).mean()), "training_log_ppl": float((-old_mean).mean()),
        "rollout_ppl": float(np.exp(-behaviour_mean).mean()), "rollout_log_ppl": float((-behaviour_mean).mean()),
        "kl": float((-every).mean()), "k3_kl": float((np.exp(every) - every - 1).mean()),
        "log_ppl_diff": float(difference.mean()), "log_ppl_abs_diff": float(np.abs(difference).mean()),
        "log_ppl_diff_max": float(difference.max()), "log_ppl_diff_min": float(difference.min()),
        "ppl_ratio": float(np.exp(difference).mean()),
        "chi2_token": float((np.exp(clamped) ** 2).mean() - 1), "chi2_seq": float(np.exp(2 * sums).mean() - 1),
    }


def _weight_metrics(prefix: str, weights: Sequence[np.ndarray], level: str, upper: float,
                    lower: float) -> dict[str, float]:
    """verl's `compute_is_metrics` on the masked, untruncated weights of rows (the same statistics
    name the rejection ratios, with prefix rollout_rs)."""
    every = np.concatenate(weights)
    if level == "sequence":  # one weight per row, in log space for the bounds
        per_row = np.array([w[0] for w in weights])
        low_fraction, high_fraction = float((per_row < lower).mean()), float((per_row > upper).mean())
    else:
        low_fraction, high_fraction = float((every < lower).mean()), float((every > upper).mean())
    clipped = np.clip(every, lower, upper)
    row_means = np.array([w.mean() for w in weights])
    return {
        f"{prefix}_mean": float(every.mean()), f"{prefix}_max": float(every.max()), f"{prefix}_min": float(every.min()),
        f"{prefix}_ratio_fraction_high": high_fraction, f"{prefix}_ratio_fraction_low": low_fraction,
        f"{prefix}_std": float(math.sqrt(max((clipped**2).mean() - clipped.mean() ** 2, 0.0))),
        f"{prefix}_eff_sample_size": float(1.0 / ((clipped / (clipped.mean() + 1e-8)) ** 2).mean()),
        f"{prefix}_seq_mean": float(row_means.mean()), f"{prefix}_seq_std": float(row_means.std()),
        f"{prefix}_seq_max": float(row_means.max()), f"{prefix}_seq_min": float(row_means.min()),
        f"{prefix}_seq_max_deviation": float(np.abs(row_means - 1).max()),
        f"{prefix}_seq_fraction_high": float((row_means > upper).mean()),
        f"{prefix}_seq_fraction_low": float((row_means < lower).mean()),
    }


def _ratio(log_ratio: np.ndarray, level: str) -> np.ndarray:
    """exp of the clamped log-ratio at `level`: per token, or one for the row (sum, or mean:
    geometric) on each of its tokens."""
    if level == "token":
        return np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    total = log_ratio.sum() if level == "sequence" else log_ratio.mean()
    return np.full(len(log_ratio), math.exp(min(max(total, -SAFETY_BOUND), SAFETY_BOUND)))


def correct(rows: Sequence[PurifiedRow], config: TrainConfig) -> Corrected:
    """The iteration's rows after rollout correction, and its metrics (module notes)."""
    located = [_log_ratios(row) for row in rows]
    ratios = [log_ratio for _, log_ratio in located]
    old = [np.asarray(row.old_logprobs, dtype=np.float64)[positions] for row, (positions, _) in zip(rows, located,
                                                                                                   strict=True)]
    metrics = offpolicy_metrics(ratios, old)
    keep = [np.ones(len(log_ratio), dtype=bool) for log_ratio in ratios]
    if config.rollout_rs is not None:
        upper = config.rollout_rs_threshold
        lower = config.rollout_rs_threshold_lower if config.rollout_rs_threshold_lower is not None else 1 / upper
        rs = [_ratio(log_ratio, config.rollout_rs) for log_ratio in ratios]
        metrics |= _weight_metrics("rollout_rs", [r for r in rs if len(r)], config.rollout_rs, upper, lower)
        keep = [k & (r >= lower) & (r <= upper) for k, r in zip(keep, rs, strict=True)]
    if config.rollout_token_veto_threshold is not None:
        floor = math.log(config.rollout_token_veto_threshold)
        vetoed = [bool((log_ratio < floor).any()) for log_ratio in ratios]
        metrics["rollout_is_veto_fraction"] = float(np.mean(vetoed)) if vetoed else 0.0
        metrics["rollout_is_catastrophic_token_fraction"] = float(np.mean(np.concatenate(ratios) < floor)) \
            if ratios else 0.0
        keep = [k & (not veto) for k, veto in zip(keep, vetoed, strict=True)]
    if config.rollout_rs is not None or config.rollout_token_veto_threshold is not None:
        masked = np.concatenate([~k for k in keep]) if keep else np.zeros(0)
        metrics["rollout_rs_masked_fraction"] = float(masked.mean()) if len(masked) else 0.0
        metrics["rollout_rs_seq_masked_fraction"] = float(np.mean([(~k).any() for k in keep])) if keep else 0.0
    weights = None
    if config.rollout_is is not None:
        weights = [_ratio(log_ratio, config.rollout_is) for log_ratio in ratios]
        threshold = config.rollout_is_threshold
        metrics |= _weight_metrics("rollout_is", [w for w in weights if len(w)], config.rollout_is, threshold,
                                   1 / threshold)
        weights = [np.minimum(w, threshold) for w in weights]
        if config.rollout_is_batch_normalize:
            pieces = [w[:1] for w in weights if len(w)] if config.rollout_is == "sequence" else weights
            mean = float(np.concatenate(pieces).mean()) if pieces else 0.0
            if mean > 1e-8:
                weights = [w / mean for w in weights]
                metrics["rollout_is_batch_norm_factor"] = mean
    corrected = []
    for row, (positions, _), kept, index in zip(rows, located, keep, range(len(rows)), strict=True):
        if not kept.any():
            continue  # every loss token rejected: nothing of the row is trained
        corrected.append(_applied(row, positions, kept, None if weights is None else weights[index]))
    return Corrected(corrected, metrics)


def _applied(row: PurifiedRow, positions: np.ndarray, kept: np.ndarray, weights: np.ndarray | None) -> PurifiedRow:
    """`row` with its rejected tokens out of the loss mask and its IS weights in its advantages."""
    if kept.all() and weights is None:
        return row
    mask = list(row.loss_mask)
    for position in positions[~kept]:
        mask[position] = 0
    advantages = list(row.token_advantages) if row.token_advantages is not None else [row.advantage] * len(mask)
    if weights is not None:
        for position, weight in zip(positions, weights, strict=True):
            advantages[position] *= float(weight)
    return dataclasses.replace(row, loss_mask=tuple(mask), token_advantages=tuple(advantages))
