"""GRPO/DAPO loss math as small module-level torch functions (docs/architecture.md §7).

Design decisions:
- Every per-token tensor is aligned with the row's `token_ids`: position t holds the quantity for
  token t predicted from positions < t. `token_log_probs` therefore returns 0 at t = 0 (nothing
  predicts the first token), which lines up with `PurifiedRow.old_logprobs` and `loss_mask`.
- The policy losses are verl's (`core_algos.py` of the reference's verl 0.7.0.dev), one function
  per `loss_mode` in `POLICY_LOSSES`, each the same arithmetic on (M,) values at a packed micro
  batch's loss tokens or on (B, T) padded ones (`Rows` says where each value's row is). Each is
  aggregated by `aggregation.py` with the mini batch's totals, so the micro batches' losses and
  metrics add up to the mini batch's; the metrics (verl's pg_clipfrac, ppo_kl, pg_clipfrac_lower,
  and cleaner's k3 approx_kl) are token means whatever the aggregation, each mode reporting what
  verl's function reports (0 where it has none).
- Asymmetric clip ("clip-higher"): the ratio is clipped to [1 - eps_low, 1 + eps_high]; vanilla's
  dual clip is optional (verl always applies its clip_ratio_c, default 3; cleaner's is 10, 0 = off).
- Rollout correction's IS weights multiply each token's loss (vanilla, gspo, cispo), or enter
  geo_mean's row loss as their geometric mean over the row, as verl's losses take them; the
  paper's default is off (docs/architecture.md §7).
- Every log-ratio is taken at loss tokens only (0 elsewhere), so garbage at a masked position never
  reaches an exp or a sum.
- Overlong shaping changes rewards, so the trainer recomputes advantages with the purify config's
  estimator (`cleaner.engine.purify.advantages.advantages`).

Shapes: B sequences, T tokens, V vocabulary, M loss tokens of a packed micro batch, R its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cleaner.config import GSPO_AGG_MODE, LossMode
from cleaner.engine.train.aggregation import SEQ_MEAN_EPS, BatchTotals, Rows, aggregate, row_mean

# ---------------------------------------------------------------------------
# Elementary pieces


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log pi(token_ids[:, t] | token_ids[:, :t]) from the model's logits on token_ids.

    logits (B, T, V) -> (B, T); position 0 is 0 because nothing predicts the first token.
    """
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    next_tokens = token_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    picked = log_probs.gather(-1, next_tokens).squeeze(-1)  # (B, T-1)
    return F.pad(picked, (1, 0), value=0.0)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like `token_log_probs`.

    logits (B, T, V) -> (B, T); position t: entropy of the distribution that predicted token t.
    """
    logits = logits[:, :-1].float()  # (B, T-1, V)
    probs = F.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # (B, T-1)
    return F.pad(entropy, (1, 0), value=0.0)  # (B, T)


K3_LOG_RATIO_BOUND = 20.0  # verl's low_var_kl: the log-ratio is clamped to +-20 before exp
K3_MAX = 10.0  # and each token's k3 to at most 10


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = exp(d) - d - 1 >= 0 of d = log(q / p), clamped as verl's low_var_kl: d to
    [-20, 20], the value to at most 10, so one token whose probabilities moved apart cannot make the
    estimate (and its gradient) explode; same shape in and out."""
    d = torch.clamp(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(d) - d - 1.0, max=K3_MAX)


def _token_total(loss_mask: torch.Tensor, num_loss_tokens: float | None) -> float | torch.Tensor:
    if num_loss_tokens is not None:
        return max(float(num_loss_tokens), 1.0)
    return loss_mask.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------
# Policy losses, named as verl's policy_loss.loss_mode

GEO_WEIGHT_EPS = 1e-10  # verl's guard of log(weight) in geo_mean


@dataclass(frozen=True)
class Clip:
    """The clip parameters of the policy losses (verl's clip_ratio_low, clip_ratio_high, clip_ratio_c)."""

    low: float  # eps_low: the ratio's lower bound is 1 - low (geo_mean: the log-ratio's, -low)
    high: float  # eps_high: the upper bound is 1 + high (geo_mean: the log-ratio's, high)
    dual: float | None = None  # vanilla's dual clip c for negative advantages; None: off


@dataclass(frozen=True)
class Surrogate:
    """What a policy loss reads, every tensor of `rows.mask`'s shape."""

    log_probs: torch.Tensor  # differentiable
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    rows: Rows  # each value's row, the micro batch's rows, the loss mask
    is_weights: torch.Tensor | None = None  # rollout correction's IS weights; None: off


@dataclass(frozen=True)
class PolicyLossOutput:
    """A micro batch's policy loss and its shares of the mini batch's metrics (token means)."""

    loss: torch.Tensor  # scalar, differentiable: verl's actor/pg_loss (its share)
    clip_fraction: torch.Tensor  # actor/pg_clipfrac: share of loss tokens whose gradient the clip removed
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi) over loss tokens (cleaner's)
    ppo_kl: torch.Tensor  # actor/ppo_kl: the mean of log pi_old - log pi
    clip_fraction_lower: torch.Tensor  # actor/pg_clipfrac_lower: share of negative-advantage tokens the dual clip capped


def _log_ratio(s: Surrogate) -> torch.Tensor:
    """log pi - log pi_old at the loss tokens, 0 elsewhere (garbage there cannot leak)."""
    return torch.where(s.rows.mask > 0, s.log_probs - s.old_log_probs, 0.0)


def _token_mean(values: torch.Tensor, s: Surrogate, totals: BatchTotals) -> torch.Tensor:
    return aggregate(values.to(s.log_probs.dtype), s.rows, "token-mean", totals)  # a flag counts as 1


@torch.no_grad()
def _output(loss: torch.Tensor, s: Surrogate, totals: BatchTotals, kl_log_ratio: torch.Tensor,
            clipped: torch.Tensor, clipped_lower: torch.Tensor | None) -> PolicyLossOutput:
    """The loss with its metrics as verl's loss function reports them (`kl_log_ratio` is the one
    its ppo_kl averages), each the micro batch's share of the mini batch's token mean."""
    bounded = torch.clamp(_log_ratio(s), -20.0, 20.0)
    lower = _token_mean(clipped_lower, s, totals) if clipped_lower is not None else torch.zeros((), device=loss.device)
    return PolicyLossOutput(loss=loss, clip_fraction=_token_mean(clipped, s, totals),
                            approx_kl=_token_mean(k3_kl(-bounded), s, totals),
                            ppo_kl=_token_mean(-kl_log_ratio, s, totals), clip_fraction_lower=lower)


def _weighted(values: torch.Tensor, s: Surrogate) -> torch.Tensor:
    return values if s.is_weights is None else values * s.is_weights


def vanilla(s: Surrogate, clip: Clip, mode: str, totals: BatchTotals) -> PolicyLossOutput:
    """verl's compute_policy_loss_vanilla: PPO's clipped surrogate, asymmetric clip, the dual clip
    capping a negative advantage's loss at -A c (a token whose ratio exploded, typically one whose
    context SAAR rewrote, cannot dominate the step); aggregated as `mode`."""
    log_ratio = torch.clamp(_log_ratio(s), -20.0, 20.0)  # as verl: keeps exp() finite
    ratio = torch.exp(log_ratio)
    unclipped = -s.advantages * ratio
    clipped = -s.advantages * torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high)
    per_token = torch.maximum(unclipped, clipped)
    lower = None
    if clip.dual is not None:
        capped = -s.advantages * clip.dual
        lower = (per_token > capped) & (s.advantages < 0)
        per_token = torch.where(s.advantages < 0, torch.minimum(capped, per_token), per_token)
    loss = aggregate(_weighted(per_token, s), s.rows, mode, totals)
    return _output(loss, s, totals, log_ratio, clipped > unclipped, lower)


def gspo(s: Surrogate, clip: Clip, mode: str, totals: BatchTotals) -> PolicyLossOutput:
    """verl's compute_policy_loss_gspo: every token's ratio is its row's geometric-mean ratio
    (gradient through its own log-probability only), clamped at e^10 in log space, clipped as
    vanilla's, aggregated seq-mean-token-mean whatever `mode` (verl forces it)."""
    log_ratio = _log_ratio(s)
    row_log_ratio = s.rows.sums(log_ratio) / s.rows.tokens(log_ratio.dtype).clamp(min=1)  # (R,)
    log_seq_ratio = s.log_probs - s.log_probs.detach() + row_log_ratio.detach()[s.rows.index]
    ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    unclipped = -s.advantages * ratio
    clipped = -s.advantages * torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high)
    loss = aggregate(_weighted(torch.maximum(unclipped, clipped), s), s.rows, GSPO_AGG_MODE, totals)
    return _output(loss, s, totals, log_ratio, clipped > unclipped, None)


def cispo(s: Surrogate, clip: Clip, mode: str, totals: BatchTotals) -> PolicyLossOutput:
    """verl's compute_policy_loss_cispo: -sg(clip(ratio)) A log pi per token, so the clip bounds
    each token's weight but never removes its gradient; aggregated as `mode`."""
    log_ratio = torch.clamp(_log_ratio(s), -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    bounded = torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high)
    per_token = -bounded.detach() * s.advantages * s.log_probs
    loss = aggregate(_weighted(per_token, s), s.rows, mode, totals)
    return _output(loss, s, totals, log_ratio, ratio != bounded, None)


def geo_mean(s: Surrogate, clip: Clip, mode: str, totals: BatchTotals) -> PolicyLossOutput:
    """verl's compute_policy_loss_geo_mean (GMPO): per row, -mean(A) x the geometric mean of its
    token ratios, each log-ratio clipped to [-low, high] on the side its advantage's sign would
    grow; rollout correction's weights enter as their geometric mean per row; the mean over the
    mini batch's rows whatever `mode` (verl's loss ignores it)."""
    log_ratio = _log_ratio(s)
    sign = torch.sign(s.advantages)
    bounded = torch.clamp(log_ratio, -clip.low, clip.high)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    tokens = s.rows.tokens(log_ratio.dtype) + SEQ_MEAN_EPS  # (R,)
    ratio = torch.exp(s.rows.sums(kept) / tokens)  # (R,)
    per_row = -(s.rows.sums(s.advantages.to(log_ratio.dtype)) / tokens) * ratio  # (R,)
    if s.is_weights is not None:
        weights = s.is_weights.to(log_ratio.dtype)
        per_row = per_row * torch.exp(s.rows.sums(torch.log(weights + GEO_WEIGHT_EPS)) / tokens)
    was_clipped = log_ratio != bounded
    return _output(row_mean(per_row, totals), s, totals, log_ratio, was_clipped & (s.advantages > 0),
                   was_clipped & (s.advantages < 0))


POLICY_LOSSES: dict[str, Callable[[Surrogate, Clip, str, BatchTotals], PolicyLossOutput]] = {
    LossMode.VANILLA: vanilla, LossMode.GSPO: gspo, LossMode.CISPO: cispo, LossMode.GEO_MEAN: geo_mean,
}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    is_weights: torch.Tensor | None = None,
    num_loss_tokens: float | None = None,
    clip_ratio_c: float | None = None,
) -> PolicyLossOutput:
    """`vanilla`, token-mean, on a (B, T) batch.

    log_probs, old_log_probs, loss_mask, is_weights: (B, T); advantages: (B,) or (B, T).
    num_loss_tokens: the denominator (default: loss tokens in this batch). clip_ratio_c: the dual
    clip; None = off.
    """
    mask = loss_mask.to(log_probs.dtype)  # (B, T)
    if advantages.dim() < log_probs.dim():
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)  # (B, T)
    total = num_loss_tokens if num_loss_tokens is not None else float(mask.sum())
    surrogate = Surrogate(log_probs, old_log_probs, advantages, Rows.padded(mask), is_weights)
    return vanilla(surrogate, Clip(clip_eps_low, clip_eps_high, clip_ratio_c), "token-mean",
                   BatchTotals(loss_tokens=total, rows=mask.shape[0]))


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    num_loss_tokens: float | None = None,
) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref), token-mean over loss tokens; (B, T) inputs -> scalar.

    k3 = exp(ref - lp) - (ref - lp) - 1 >= 0, unbiased with low variance (Schulman 2020), clamped
    as verl's (`k3_kl`).
    """
    mask = loss_mask.to(log_probs.dtype)
    diff = torch.where(mask > 0, ref_log_probs - log_probs, 0.0)  # (B, T)
    return (k3_kl(diff) * mask).sum() / _token_total(mask, num_loss_tokens)


# ---------------------------------------------------------------------------
# Batch shaping (DAPO)


def dynamic_sampling_mask(group_ids: Sequence[str], rewards: torch.Tensor) -> torch.Tensor:
    """True for rows whose group has at least two different rewards; (B,) -> (B,) bool.

    A group whose rewards are all equal (all right, all wrong, or a single row) has zero advantage
    everywhere and only dilutes the token mean, so DAPO drops it.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    keep = torch.zeros(len(group_ids), dtype=torch.bool)
    for group in set(group_ids):
        members = torch.tensor([g == group for g in group_ids])
        group_rewards = rewards[members]
        keep[members] = bool(group_rewards.max() - group_rewards.min() > 1e-9)
    return keep


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward; (B,) -> (B,).

    0 up to max_len - buffer, then falling linearly to -1 at max_len, -1 beyond. buffer 0: all 0.
    """
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    expected = max_len - buffer
    ramp = (expected - lengths) / buffer  # (B,), negative inside the buffer
    return torch.where(lengths <= expected, torch.zeros_like(lengths), ramp.clamp(min=-1.0))
