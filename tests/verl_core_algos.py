"""verl's objectives (`verl/trainer/ppo/core_algos.py` and `verl/utils/torch_functional.py`, 0.7.0.dev
as the reference vendors it) transcribed for the tests: `agg_loss` with its global batch
information, the policy losses vanilla, gspo, cispo and geo_mean, `kl_penalty` (low_var_kl), the
estimators grpo, rloo and reinforce_plus_plus_baseline and `masked_whiten`, each the same tensor
operations on the batch verl builds, so cleaner's step and purify's advantages are checked against
verl's arithmetic rather than against themselves. Where verl itself is importable
(tools/verl-reference/setup.sh's environment), `verl_core_algos()` returns its module and
`verl_policy_loss` calls it, so the tests run against both.

The batch is verl's: each row's response (the tokens after its prompt) right-padded to the longest,
`response_mask` 1 at its loss tokens (0 at tool spans and padding); tensors are float64, so a
comparison measures the arithmetic, not float32's rounding. `config` is what verl's functions read
of an ActorConfig: the clip ratios, clip_ratio_c and `global_batch_info`.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

# ---------------------------------------------------------------------------
# verl/utils/torch_functional.py


def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# ---------------------------------------------------------------------------
# core_algos.py: agg_loss and the policy losses


@dataclass
class ActorConfig:
    """What the policy losses read of verl's ActorConfig."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    global_batch_info: dict = field(default_factory=dict)

    def get(self, key, default=None):
        return getattr(self, key, default)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode.startswith("seq-mean"):
        if global_batch_size is not None:
            seq_denominator = global_batch_size * dp_size
        else:
            local_bsz = loss_mat.shape[0]
            seq_denominator = local_bsz
        if loss_agg_mode.startswith("seq-mean-token-sum"):
            seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
            if loss_agg_mode == "seq-mean-token-sum":
                pass
            elif loss_agg_mode == "seq-mean-token-sum-norm":
                if loss_scale_factor is None:
                    loss_scale_factor = loss_mask.shape[-1]
                seq_losses = seq_losses / loss_scale_factor
            else:
                raise ValueError(f"Invalid {loss_agg_mode=}")
        elif loss_agg_mode == "seq-mean-token-mean":
            token_counts = torch.sum(loss_mask, dim=-1)
            seq_losses = masked_sum(loss_mat, loss_mask, axis=-1) / (token_counts + 1e-8)
        else:
            raise ValueError(f"Invalid {loss_agg_mode=}")
        loss = torch.sum(seq_losses) / seq_denominator
    else:
        raise ValueError(f"Invalid {loss_agg_mode=}")
    return loss


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    clip_ratio = config.clip_ratio
    cliprange_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    cliprange_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    assert clip_ratio_c > 1.0
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean",
                       **config.global_batch_info)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None):
    clip_ratio = config.clip_ratio
    cliprange_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    cliprange_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_is_weights=None):
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


POLICY_LOSSES = {"vanilla": compute_policy_loss_vanilla, "gspo": compute_policy_loss_gspo,
                 "cispo": compute_policy_loss_cispo, "geo_mean": compute_policy_loss_geo_mean}


def kl_penalty(logprob, ref_logprob, kl_penalty="low_var_kl"):
    assert kl_penalty in ("low_var_kl", "k3")  # the one cleaner has
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = (ratio - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


# ---------------------------------------------------------------------------
# core_algos.py: the advantage estimators


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx], id2std[idx] = torch.mean(scores_tensor), torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[index[i]] * response_num / (
                    response_num - 1)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


ESTIMATORS = {"grpo": compute_grpo_outcome_advantage, "rloo": compute_rloo_outcome_advantage,
              "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage}


def outcome_rewards(rewards, response_mask) -> torch.Tensor:
    """verl's token_level_rewards: each row's reward at its last response token, 0 elsewhere. (B, T)"""
    token_level = torch.zeros_like(response_mask, dtype=torch.float64)
    for row, reward in enumerate(rewards):
        last = int(torch.nonzero(response_mask[row]).max()) if response_mask[row].any() else 0
        token_level[row, last] = reward
    return token_level


# ---------------------------------------------------------------------------
# verl itself, where it is importable


def verl_core_algos():
    """verl's own core_algos where verl is importable, else None."""
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError:
        return None


def verl_actor_config(config: ActorConfig):
    """verl's ActorConfig holding the transcription's settings (its losses assert its type)."""
    from verl.workers.config import ActorConfig as VerlActorConfig

    actor = VerlActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                            clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low,
                            clip_ratio_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c)
    actor.global_batch_info.update(config.global_batch_info)
    return actor


def policy_loss_of(module):
    """`(name, **kwargs) -> (pg_loss, metrics)` calling the transcription's function or, given
    verl's module, verl's own with its ActorConfig."""
    def call(name, *, config, **kwargs):
        if module is None:
            return POLICY_LOSSES[name](config=config, **kwargs)
        return module.get_policy_loss_fn(name)(config=verl_actor_config(config), **kwargs)
    return call


def estimator_of(module, name):
    """The estimator `name`: the transcription's or, given verl's module, verl's own."""
    return ESTIMATORS[name] if module is None else module.get_adv_estimator_fn(name)


def index_array(group_ids) -> np.ndarray:
    """verl's `index` (the uid of each row's prompt) as the trainer passes it."""
    return np.array(list(group_ids), dtype=object)
