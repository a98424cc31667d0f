"""GRPO/DAPO loss math as small module-level torch functions (docs/architecture.md §7).

Design decisions:
- Every per-token tensor is aligned with the row's `token_ids`: position t holds the quantity for
  token t predicted from positions < t. `token_log_probs` therefore returns 0 at t = 0 (nothing
  predicts the first token), which lines up with `PurifiedRow.old_logprobs` and `loss_mask`.
- Token-mean (DAPO): losses are sum over loss tokens / number of loss tokens of the WHOLE batch,
  not a mean of per-row means, so long and short rows weigh each token equally. `num_loss_tokens`
  lets a micro batch be normalised by its mini batch's total, so accumulating micro-batch gradients
  equals one big batch. The reported metrics (clip fraction, approx KL) use the same normalisation,
  so micro-batch values simply add up to the mini-batch value.
- Asymmetric clip ("clip-higher"): the ratio is clipped to [1 - eps_low, 1 + eps_high].
- `policy_loss` takes per-token weights on the surrogate (verl's rollout_is_weights); the train
  step puts rollout correction's in the advantages instead (rollout_correction.py), which is the
  same for weights >= 0; the paper's default is off (docs/architecture.md §7).
- Overlong shaping changes rewards, so the trainer recomputes advantages with the same GRPO
  normalisation purify uses (`cleaner.engine.purify.advantages.grpo_advantages`).

Shapes: B sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
# Policy objective


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable: token-mean of the clipped surrogate (negated)
    clip_fraction: torch.Tensor  # scalar: share of loss tokens whose gradient the clip removed
    approx_kl: torch.Tensor  # scalar: k3 estimate of KL(pi_old || pi) over loss tokens


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
    """PPO clipped surrogate with asymmetric clip and DAPO token-mean.

    log_probs, old_log_probs, loss_mask, is_weights: (B, T); advantages: (B,) or (B, T).
    num_loss_tokens: the denominator (default: loss tokens in this batch).
    clip_ratio_c: dual clip (as verl): for negative advantages the per-token loss is capped at
    -A * c, so a token whose ratio exploded (typically one whose context SAAR rewrote, with a very
    low old log-prob) cannot dominate the step. None = off.
    """
    mask = loss_mask.to(log_probs.dtype)  # (B, T)
    if advantages.dim() < log_probs.dim():
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    log_ratio = torch.where(mask > 0, log_probs - old_log_probs, 0.0)  # (B, T); 0 when masked
    log_ratio = torch.clamp(log_ratio, -20.0, 20.0)  # as verl: keeps exp() finite
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if clip_ratio_c is not None:
        capped = torch.minimum(per_token, -advantages * clip_ratio_c)  # (B, T)
        per_token = torch.where(advantages < 0, capped, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    total = _token_total(mask, num_loss_tokens)
    loss = (per_token * mask).sum() / total
    with torch.no_grad():
        was_clipped = ((ratio > 1.0 + clip_eps_high) & (advantages > 0)) | (
            (ratio < 1.0 - clip_eps_low) & (advantages < 0)
        )
        clip_fraction = (was_clipped.to(mask.dtype) * mask).sum() / total
        approx_kl = (k3_kl(-log_ratio) * mask).sum() / total
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl)


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
