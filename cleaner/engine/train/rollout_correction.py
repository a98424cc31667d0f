"""Rollout correction as verl computes it (`verl/trainer/ppo/rollout_corr_helper.py`, v0.7.0: the
version the reference ships): the mismatch between the policy that sampled a rollout (its
behaviour log-probs) and the policy that trains on it (the old log-probs the scorer recomputed),
measured, and optionally corrected by truncated importance weights and rejection sampling
(docs/architecture.md §7).

Design decisions, verl's unless said:
- A row is what verl's batch holds of it: its loss tokens are verl's response_mask (the prompt and
  the tool spans are not; position 0 never is). Per loss token, log_ratio = log pi_old - log
  pi_behaviour; nothing else of the row is read.
- IS weights (`rollout_is`): token level exp(clamp(log_ratio, +-20)); sequence level exp(clamp(sum
  of the row's log_ratio, +-20)) on every token of it. Their metrics are taken before truncation;
  then each is truncated at `rollout_is_threshold` (above only) and, with
  `rollout_is_batch_normalize`, divided by their mean over every loss token of the batch (sequence
  level: over the rows that have one), rejected ones included, as verl normalises before it
  rejects; a mean <= 1e-8 leaves them as they are (factor 1). The weights go to the policy loss
  beside the advantages (`Corrected.is_weights`), which composes them as verl's loss mode does: a
  token's loss times its weight, or for geo_mean (GMPO) a row's loss times its weights' geometric
  mean (loss.py).
- Rejection sampling (`rollout_rs`): a ratio exp(clamp(.)) of log_ratio per token (`token`), of its
  sum (`sequence`) or of its mean over the loss tokens (`geometric`), kept within [lower, upper]
  (`rollout_rs_threshold`, `rollout_rs_threshold_lower`, which defaults to 1 / upper): a rejected
  token (token level) or row (sequence, geometric) leaves the loss mask.
  `rollout_token_veto_threshold` rejects a whole row with any token whose unclamped log_ratio is
  below log(threshold) (so a ratio below e^-20 is seen).
- The batch is verl's whatever is rejected: every row stays, a rejected one with a zero loss mask,
  so the mini batches, the optimiser steps and the token-mean denominators are verl's.
- Metrics (`rollout_corr/...` in verl's names, without the prefix) are computed every iteration,
  correction on or off, over every row given (a row without loss tokens counts as verl counts it:
  0 as its mean log-prob and mean weight, 1 as its sequence ratio): perplexities of both policies
  and their differences, k1 and k3 KL estimates, chi-squared, the veto's two fractions (0 with the
  veto off), and the IS and RS statistics when those are on: token-weighted means, the bounds'
  fractions over tokens (token level) or rows (sequence, geometric, in log space), at sequence
  level the unclamped max and min (the max capped at e^20), the sample std of the rows' mean
  weights. `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction` are rejection
  sampling's alone (the veto has its own). A batch without any loss token has no metrics (verl
  raises there).
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
NORMALIZE_FLOOR = 1e-8  # verl's: a batch-normalisation mean at or below it is not divided by
ESS_EPS = 1e-8  # verl's guard in the effective sample size


@dataclasses.dataclass(frozen=True)
class Corrected:
    """The rows to train (every row given: rejected tokens out of their masks), their IS weights and
    the iteration's rollout-correction metrics."""

    rows: list[PurifiedRow]
    metrics: dict[str, float]
    # id(row) of a row of `rows` -> its IS weight per token, aligned with its token_ids (1 where it
    # is not a loss token); empty with rollout_is off
    is_weights: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)


def _log_ratios(row: PurifiedRow) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss positions, log_ratio = old - behaviour at them, old at them) of a row; position 0 is
    never a loss token (nothing predicts it)."""
    mask = np.fromiter(row.loss_mask, dtype=np.int8, count=len(row.loss_mask)) > 0
    mask[:1] = False
    positions = np.flatnonzero(mask)
    old = np.asarray(row.old_logprobs, dtype=np.float64)[positions]
    behaviour = np.asarray(row.behavior_logprobs, dtype=np.float64)[positions]
    return positions, old - behaviour, old


def _row_means(values: Sequence[np.ndarray]) -> np.ndarray:
    """Each row's mean, 0 for a row without tokens (verl's masked mean over an empty mask). (B,)"""
    return np.array([v.mean() if len(v) else 0.0 for v in values])


def _exp_clamped(x):
    return np.exp(np.clip(x, -SAFETY_BOUND, SAFETY_BOUND))


def offpolicy_metrics(ratios: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics` over rows' log-ratios (old - behaviour) and old log-probs
    at their loss tokens; a row without any counts with mean log-probs 0."""
    every = np.concatenate(ratios)  # (N,)
    behaviour_mean = _row_means([o - log_ratio for log_ratio, o in zip(ratios, old, strict=True)])  # (B,)
    old_mean = _row_means(old)
    difference = behaviour_mean - old_mean
    sums = np.clip([log_ratio.sum() for log_ratio in ratios], -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(np.exp(-old_mean).mean()), "training_log_ppl": float((-old_mean).mean()),
        "rollout_ppl": float(np.exp(-behaviour_mean).mean()), "rollout_log_ppl": float((-behaviour_mean).mean()),
        "kl": float((-every).mean()), "k3_kl": float((np.exp(every) - every - 1).mean()),
        "log_ppl_diff": float(difference.mean()), "log_ppl_abs_diff": float(np.abs(difference).mean()),
        "log_ppl_diff_max": float(difference.max()), "log_ppl_diff_min": float(difference.min()),
        "ppl_ratio": float(np.exp(difference).mean()),
        "chi2_token": float((_exp_clamped(every) ** 2).mean() - 1), "chi2_seq": float(np.exp(2 * sums).mean() - 1),
    }


@dataclasses.dataclass(frozen=True)
class _Ratios:
    """Rows' ratios at one level: per loss token, and per row the unclamped log of its one ratio
    (sequence: the sum, geometric: the mean; None at token level)."""

    weights: list[np.ndarray]  # per row, (n_b,) exp(clamp(.)) at its loss tokens
    row_logs: np.ndarray | None  # (B,)


def _level_ratios(ratios: Sequence[np.ndarray], level: str) -> _Ratios:
    if level == "token":
        return _Ratios([_exp_clamped(log_ratio) for log_ratio in ratios], None)
    row_logs = np.array([log_ratio.sum() for log_ratio in ratios]) if level == "sequence" else _row_means(ratios)
    return _Ratios([np.full(len(r), _exp_clamped(s)) for r, s in zip(ratios, row_logs, strict=True)], row_logs)


def _weight_metrics(prefix: str, level: _Ratios, upper: float, lower: float) -> dict[str, float]:
    """verl's `compute_is_metrics` / `compute_rs_metrics` (the same statistics, prefixed) on untruncated
    ratios, with the bounds `upper` and `lower`."""
    every = np.concatenate(level.weights)  # (N,)
    if level.row_logs is not None:  # one ratio per row: bounds in log space, over rows, unclamped
        logs = level.row_logs
        high, low = float((logs > math.log(upper)).mean()), float((logs < math.log(lower)).mean())
        largest, smallest = math.exp(min(logs.max(), SAFETY_BOUND)), math.exp(logs.min())
    else:
        high, low = float((every > upper).mean()), float((every < lower).mean())
        largest, smallest = float(every.max()), float(every.min())
    clipped = np.clip(every, lower, upper)
    variance = (clipped**2).mean() - clipped.mean() ** 2
    row_means = _row_means(level.weights)  # (B,)
    return {
        f"{prefix}_mean": float(every.mean()), f"{prefix}_max": largest, f"{prefix}_min": smallest,
        f"{prefix}_ratio_fraction_high": high, f"{prefix}_ratio_fraction_low": low,
        f"{prefix}_std": float(math.sqrt(max(variance, 0.0))) if len(every) > 1 else 0.0,
        f"{prefix}_eff_sample_size": float(1.0 / ((clipped / (clipped.mean() + ESS_EPS)) ** 2).mean()),
        f"{prefix}_seq_mean": float(row_means.mean()),
        f"{prefix}_seq_std": float(row_means.std(ddof=1)) if len(row_means) > 1 else 0.0,
        f"{prefix}_seq_max": float(row_means.max()), f"{prefix}_seq_min": float(row_means.min()),
        f"{prefix}_seq_max_deviation": float(np.abs(row_means - 1).max()),
        f"{prefix}_seq_fraction_high": float((row_means > upper).mean()),
        f"{prefix}_seq_fraction_low": float((row_means < lower).mean()),
    }


def _rejection(ratios: Sequence[np.ndarray], config: TrainConfig) -> tuple[list[np.ndarray], dict[str, float]]:
    """Which loss tokens rejection sampling keeps, per row, and its metrics."""
    upper = config.rollout_rs_threshold
    lower = config.rollout_rs_threshold_lower if config.rollout_rs_threshold_lower is not None else 1 / upper
    level = _level_ratios(ratios, config.rollout_rs)
    metrics = _weight_metrics("rollout_rs", level, upper, lower)
    keep = [(w >= lower) & (w <= upper) for w in level.weights]
    metrics["rollout_rs_masked_fraction"] = float(np.mean(~np.concatenate(keep)))
    if level.row_logs is None:  # a row counts when any of its tokens is rejected
        rejected = [bool((~k).any()) for k in keep]
    else:  # a row's one ratio, 1 for a row without tokens
        row_ratio = _exp_clamped(level.row_logs)
        rejected = list(~((row_ratio >= lower) & (row_ratio <= upper)))
    metrics["rollout_rs_seq_masked_fraction"] = float(np.mean(rejected))
    return keep, metrics


def _veto(ratios: Sequence[np.ndarray], threshold: float | None) -> tuple[list[bool], dict[str, float]]:
    """The rows the veto rejects (any token's unclamped log_ratio below log(threshold)) and its
    metrics, 0 with the veto off."""
    if threshold is None:
        return [False] * len(ratios), {"rollout_is_veto_fraction": 0.0, "rollout_is_catastrophic_token_fraction": 0.0}
    floor = math.log(threshold)
    vetoed = [bool((log_ratio < floor).any()) for log_ratio in ratios]
    return vetoed, {"rollout_is_veto_fraction": float(np.mean(vetoed)),
                    "rollout_is_catastrophic_token_fraction": float(np.mean(np.concatenate(ratios) < floor))}


def _is_weights(ratios: Sequence[np.ndarray], config: TrainConfig) -> tuple[list[np.ndarray], dict[str, float]]:
    """The truncated (and batch-normalised) IS weights at each row's loss tokens, and their metrics."""
    threshold = config.rollout_is_threshold
    level = _level_ratios(ratios, config.rollout_is)
    metrics = _weight_metrics("rollout_is", level, threshold, 1 / threshold)
    weights = [np.minimum(w, threshold) for w in level.weights]
    if config.rollout_is_batch_normalize:
        # over every loss token (sequence level: every row with one), rejected ones included
        pieces = weights if config.rollout_is == "token" else [w[:1] for w in weights if len(w)]
        mean = float(np.concatenate(pieces).mean())
        factor = mean if mean > NORMALIZE_FLOOR else 1.0
        weights = [w / factor for w in weights]
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def correct(rows: Sequence[PurifiedRow], config: TrainConfig) -> Corrected:
    """The iteration's rows after rollout correction, their IS weights and its metrics (module notes)."""
    located = [_log_ratios(row) for row in rows]
    ratios = [log_ratio for _, log_ratio, _ in located]
    if not sum(len(log_ratio) for log_ratio in ratios):
        return Corrected(list(rows), {})  # nothing is trained, nothing to measure
    metrics: dict[str, float] = {}
    weights: list[np.ndarray | None] = [None] * len(rows)
    if config.rollout_is is not None:
        weights, is_metrics = _is_weights(ratios, config)
        metrics |= is_metrics
    keep = [np.ones(len(log_ratio), dtype=bool) for log_ratio in ratios]
    if config.rollout_rs is not None:
        keep, rs_metrics = _rejection(ratios, config)
        metrics |= rs_metrics
    vetoed, veto_metrics = _veto(ratios, config.rollout_token_veto_threshold)
    metrics |= veto_metrics
    metrics |= offpolicy_metrics(ratios, [old for _, _, old in located])
    corrected = [_applied(row, positions, kept & (not veto))
                 for row, (positions, _, _), kept, veto in zip(rows, located, keep, vetoed, strict=True)]
    by_row = _weights_by_row(corrected, [p for p, _, _ in located], weights) if config.rollout_is is not None else {}
    return Corrected(corrected, metrics, by_row)


def _applied(row: PurifiedRow, positions: np.ndarray, kept: np.ndarray) -> PurifiedRow:
    """`row` with its rejected tokens out of the loss mask (all of them: a row verl keeps with a zero
    mask)."""
    if kept.all():
        return row
    mask = list(row.loss_mask)
    for position in positions[~kept]:
        mask[position] = 0
    return dataclasses.replace(row, loss_mask=tuple(mask))


def _weights_by_row(rows: Sequence[PurifiedRow], positions: Sequence[np.ndarray],
                    weights: Sequence[np.ndarray]) -> dict[int, tuple[float, ...]]:
    """Each row's IS weights on its tokens (1 off its loss tokens), by id(row)."""
    found = {}
    for row, where, weight in zip(rows, positions, weights, strict=True):
        per_token = np.ones(len(row.token_ids))
        per_token[where] = weight
        found[id(row)] = tuple(per_token.tolist())
    return found
