"""verl's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`, v0.7.0, as the reference
vendors it) transcribed for the tests: the same tensor operations on the same batch verl builds, so
`cleaner.engine.train.rollout_correction` is checked against verl's arithmetic rather than against
itself. Where verl itself is importable (tools/verl-reference/setup.sh's environment),
`verl_helper()` returns its module and the tests run against both.

The batch is verl's: each row's response (the tokens after its prompt) right-padded to the longest,
`response_mask` 1 at its loss tokens (0 at tool spans and padding). The tensors are float64 (verl's
are float32): the comparison then measures the arithmetic, not float32's rounding, which verl's
std (E[w^2] - E[w]^2 over weights near 1) would lose three digits to. Every
function below follows the helper's function of the same name; metrics come back with verl's
`rollout_corr/` prefix stripped.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cleaner.records import PurifiedRow

SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class VerlBatch:
    old_log_prob: torch.Tensor  # (B, T), the response's
    rollout_log_prob: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T): 1 at loss tokens


def verl_batch(rows: Sequence[PurifiedRow]) -> VerlBatch:
    """The rows as verl's trainer holds them: responses only, right-padded."""
    length = max(len(row.token_ids) - row.prompt_len for row in rows)

    def padded(values: Sequence[float], row: PurifiedRow) -> list[float]:
        response = list(values[row.prompt_len:])
        return response + [0.0] * (length - len(response))

    return VerlBatch(
        old_log_prob=torch.tensor([padded(row.old_logprobs, row) for row in rows], dtype=torch.float64),
        rollout_log_prob=torch.tensor([padded(row.behavior_logprobs, row) for row in rows], dtype=torch.float64),
        response_mask=torch.tensor([padded(row.loss_mask, row) for row in rows], dtype=torch.float64))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _level_weights(log_ratio, mask, level):
    """(weights (B, T), the unclamped log-ratio the metrics read) at `level`."""
    if level == "token":
        return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)), log_ratio
    per_row = masked_sum(log_ratio, mask, -1) if level == "sequence" else masked_mean(log_ratio, mask, -1)
    per_row = per_row.unsqueeze(-1)  # (B, 1)
    return torch.exp(per_row.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio), per_row


def weight_metrics(prefix, weights, for_metrics, mask, level, upper, lower) -> dict[str, float]:
    """compute_is_metrics / compute_rs_metrics."""
    m = {}
    if level != "token":
        m["max"] = torch.exp(for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        m["min"] = torch.exp(for_metrics.min()).item()
        m["mean"] = masked_mean(weights, mask).item()
        m["ratio_fraction_high"] = (for_metrics > torch.log(torch.tensor(upper))).float().mean().item()
        m["ratio_fraction_low"] = (for_metrics < torch.log(torch.tensor(lower))).float().mean().item()
    else:
        m["mean"] = masked_mean(weights, mask).item()
        m["ratio_fraction_high"] = masked_mean((weights > upper).float(), mask).item()
        m["ratio_fraction_low"] = masked_mean((weights < lower).float(), mask).item()
        m["max"] = weights.masked_fill(~mask.bool(), float("-inf")).max().item()
        m["min"] = weights.masked_fill(~mask.bool(), float("inf")).min().item()
    clamped = weights.clamp(min=lower, max=upper)
    if mask.sum() > 1:
        variance = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
        m["std"] = torch.sqrt(variance.clamp(min=0.0)).item()
    else:
        m["std"] = 0.0
    m["eff_sample_size"] = 1.0 / masked_mean((clamped / (masked_mean(clamped, mask) + 1e-8)).square(), mask).item()
    seq = masked_mean(weights, mask, -1)  # (B,)
    m["seq_mean"] = seq.mean().item()
    m["seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
    m["seq_max"], m["seq_min"] = seq.max().item(), seq.min().item()
    m["seq_max_deviation"] = (seq - 1.0).abs().max().item()
    m["seq_fraction_high"] = (seq > upper).float().mean().item()
    m["seq_fraction_low"] = (seq < lower).float().mean().item()
    return {f"{prefix}_{name}": value for name, value in m.items()}


def rollout_correction_weights(log_ratio, mask, level, threshold, batch_normalize):
    """compute_rollout_correction_weights: (weights (B, T), metrics)."""
    weights, for_metrics = _level_weights(log_ratio, mask, level)
    weights = weights * mask
    metrics = weight_metrics("rollout_is", weights, for_metrics, mask, level, threshold, 1.0 / threshold)
    weights = weights.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_weights = masked_mean(weights, mask, -1)
            seq_mask = (mask.sum(-1) > 0).float()
            mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def rollout_rejection_mask(log_ratio, mask, level, upper, lower):
    """compute_rollout_rejection_mask: (the response mask after rejection, metrics)."""
    lower = lower if lower is not None else 1.0 / upper
    weights, for_metrics = _level_weights(log_ratio, mask, level)
    keep = ((weights >= lower) & (weights <= upper)).float()
    metrics = weight_metrics("rollout_rs", weights, for_metrics, mask, level, upper, lower)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep, mask).item()
    if level == "token":
        metrics["rollout_rs_seq_masked_fraction"] = (masked_sum(1 - keep, mask, -1) > 0).float().mean().item()
    else:
        metrics["rollout_rs_seq_masked_fraction"] = (1 - keep[:, 0]).mean().item()
    return mask * keep, metrics


def offpolicy_metrics(old, rollout, mask) -> dict[str, float]:
    """compute_offpolicy_metrics."""
    m = {}
    training = masked_mean(old, mask, -1)
    m["training_ppl"] = torch.exp(-training).mean().item()
    m["training_log_ppl"] = (-training).mean().item()
    m["kl"] = masked_mean(rollout - old, mask).item()
    log_ratio = old - rollout
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item()
    behaviour = masked_mean(rollout, mask, -1)
    m["rollout_ppl"] = torch.exp(-behaviour).mean().item()
    m["rollout_log_ppl"] = (-behaviour).mean().item()
    difference = behaviour - training
    m["log_ppl_diff"], m["log_ppl_abs_diff"] = difference.mean().item(), difference.abs().mean().item()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = difference.max().item(), difference.min().item()
    m["ppl_ratio"] = torch.exp(difference).mean().item()
    m["chi2_token"] = (masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1).item()
    sums = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * sums).mean() - 1).item()
    return m


def correction_and_rejection_mask(batch: VerlBatch, is_level=None, is_threshold=2.0, rs_level=None,
                                  rs_threshold=2.0, rs_threshold_lower=None, veto_threshold=None,
                                  batch_normalize=False):
    """compute_rollout_correction_and_rejection_mask: (IS weights (B, T) or None, the response mask
    after rejection and veto, metrics without the prefix)."""
    old, rollout, mask = batch.old_log_prob, batch.rollout_log_prob, batch.response_mask
    log_ratio = old - rollout
    metrics: dict[str, float] = {}
    weights = None
    if is_level is not None:
        weights, is_metrics = rollout_correction_weights(log_ratio, mask, is_level, is_threshold, batch_normalize)
        metrics |= is_metrics
    modified = mask.clone()
    if rs_level is not None:
        modified, rs_metrics = rollout_rejection_mask(log_ratio, mask, rs_level, rs_threshold, rs_threshold_lower)
        metrics |= rs_metrics
    if veto_threshold is not None:
        catastrophic = (log_ratio < torch.log(torch.tensor(veto_threshold))) & mask.bool()
        has = catastrophic.any(dim=-1, keepdim=True)
        metrics["rollout_is_veto_fraction"] = has.float().mean().item()
        metrics["rollout_is_catastrophic_token_fraction"] = masked_mean(catastrophic.float(), mask).item()
        modified = modified * (~has).float()
    else:
        metrics["rollout_is_veto_fraction"] = 0.0
        metrics["rollout_is_catastrophic_token_fraction"] = 0.0
    metrics |= offpolicy_metrics(old, rollout, mask)
    return weights, modified, metrics


def verl_helper():
    """verl's own rollout_corr_helper where verl is importable, else None."""
    try:
        return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    except ImportError:
        return None


def verl_own(helper, batch: VerlBatch, **settings):
    """The same call on verl's own helper, in the transcription's return shape."""
    names = {"is_level": "rollout_is", "is_threshold": "rollout_is_threshold", "rs_level": "rollout_rs",
             "rs_threshold": "rollout_rs_threshold", "rs_threshold_lower": "rollout_rs_threshold_lower",
             "veto_threshold": "rollout_token_veto_threshold", "batch_normalize": "rollout_is_batch_normalize"}
    proto, modified, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch.old_log_prob, rollout_log_prob=batch.rollout_log_prob,
        response_mask=batch.response_mask, **{names[key]: value for key, value in settings.items()})
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    return weights, modified, {key.removeprefix("rollout_corr/"): value for key, value in metrics.items()}
