"""Rollout correction (engine/train/rollout_correction.py) worked by hand on two rows whose
behaviour and recomputed log-probs differ by known amounts, as verl's rollout_corr_helper computes
it (v0.7.0, the reference's)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from cleaner.config import TrainConfig
from cleaner.config.layers import typed_layer
from cleaner.engine.train.loss import policy_loss
from cleaner.engine.train.rollout_correction import correct
from cleaner.engine.train.step import prepare
from cleaner.records import PurifiedRow


def row(rollout_id: str, old: list[float], behaviour: list[float], advantage: float) -> PurifiedRow:
    """A prompt token, then loss tokens with these log-probs."""
    n = len(old) + 1
    return PurifiedRow(config_id="c", iteration=0, rollout_id=rollout_id, group_id="g", token_ids=tuple(range(n)),
                       prompt_len=1, loss_mask=(0,) + (1,) * (n - 1), behavior_logprobs=(0.0, *behaviour),
                       old_logprobs=(0.0, *old), reward=0.0, advantage=advantage, rolled_back=False, n_shallow=0,
                       n_deep=0, n_unrecovered=0, tokens_removed=0, scorer_version="s")


# log_ratio = old - behaviour: A (0.5, -1.0), B (0.2, 0.1, -0.1)
A = row("a", [-1.0, -2.0], [-1.5, -1.0], 2.0)
B = row("b", [-0.3, -0.4, -0.5], [-0.5, -0.5, -0.4], -1.0)


def test_off_everything_is_measured_and_nothing_changes():
    done = correct([A, B], TrainConfig())
    assert done.rows == [A, B]
    log_ratio = [0.5, -1.0, 0.2, 0.1, -0.1]
    m = done.metrics
    assert m["kl"] == pytest.approx(-sum(log_ratio) / 5)  # k1: mean of log behaviour - log old
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_ratio) / 5)
    # per row: mean log-prob of the rollout's policy minus the old policy's
    d = [(-1.5 - 1.0) / 2 - (-1.0 - 2.0) / 2, (-0.5 - 0.5 - 0.4) / 3 - (-0.3 - 0.4 - 0.5) / 3]
    assert m["log_ppl_diff"] == pytest.approx(sum(d) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx(sum(abs(x) for x in d) / 2)
    assert (m["log_ppl_diff_max"], m["log_ppl_diff_min"]) == pytest.approx((max(d), min(d)))
    assert m["ppl_ratio"] == pytest.approx(sum(math.exp(x) for x in d) / 2)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.4)) / 2)
    assert m["rollout_ppl"] == pytest.approx((math.exp(1.25) + math.exp(1.4 / 3)) / 2)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(x) ** 2 for x in log_ratio) / 5 - 1)
    assert m["chi2_seq"] == pytest.approx((math.exp(2 * -0.5) + math.exp(2 * 0.2)) / 2 - 1)


def test_token_level_is_weights_truncate_and_go_into_the_advantages():
    done = correct([A, B], TrainConfig(rollout_is="token", rollout_is_threshold=1.2))
    a, b = done.rows
    assert a.token_advantages == pytest.approx((2.0, 2.0 * 1.2, 2.0 * math.exp(-1.0)))  # e^0.5 = 1.65 > 1.2
    assert b.token_advantages == pytest.approx((-1.0, -1.2, -math.exp(0.1), -math.exp(-0.1)))  # e^0.2 = 1.22 > 1.2
    assert a.loss_mask == A.loss_mask
    m = done.metrics  # before truncation
    assert m["rollout_is_max"] == pytest.approx(math.exp(0.5)) and m["rollout_is_min"] == pytest.approx(math.exp(-1))
    assert m["rollout_is_mean"] == pytest.approx(sum(math.exp(x) for x in [0.5, -1.0, 0.2, 0.1, -0.1]) / 5)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # e^0.5 and e^0.2 > 1.2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # e^-1 < 1 / 1.2


def test_sequence_level_weights_and_batch_normalisation():
    done = correct([A, B], TrainConfig(rollout_is="sequence", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=True))
    wa, wb = math.exp(-0.5), math.exp(0.2)  # each row's sum of log_ratio
    mean = (wa + wb) / 2  # over rows
    a, b = done.rows
    assert a.token_advantages[1:] == pytest.approx((2.0 * wa / mean,) * 2)
    assert b.token_advantages[1:] == pytest.approx((-wb / mean,) * 3)
    assert done.metrics["rollout_is_batch_norm_factor"] == pytest.approx(mean)


@pytest.mark.parametrize(("level", "upper", "lower", "masks"), [
    # per token: A's e^0.5 = 1.65 is above, e^-1 = 0.37 below; B's 1.22, 1.11, 0.90 within
    ("token", 1.3, 0.5, {"b": [1, 1, 1]}),
    # per row, the sum: A's e^-0.5 = 0.61 below, B's e^0.2 = 1.22 above: nothing left
    ("sequence", 1.1, 0.7, {}),
    # per row, the mean: A's e^-0.25 = 0.78 and B's e^0.067 = 1.07 within
    ("geometric", 1.1, 0.6, {"a": [1, 1], "b": [1, 1, 1]}),
])
def test_rejection_sampling_by_token_sequence_and_geometric_mean(level, upper, lower, masks):
    done = correct([A, B], TrainConfig(rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower))
    assert {r.rollout_id: list(r.loss_mask[1:]) for r in done.rows} == masks  # a row with nothing left goes
    kept = sum(sum(mask) for mask in masks.values())
    assert done.metrics["rollout_rs_masked_fraction"] == pytest.approx(1 - kept / 5)


def test_the_lower_bound_defaults_to_one_over_the_upper_and_the_veto_rejects_a_row():
    done = correct([A, B], TrainConfig(rollout_rs="token", rollout_rs_threshold=2.0))  # [0.5, 2]
    a = next(r for r in done.rows if r.rollout_id == "a")
    assert a.loss_mask == (0, 1, 0)  # e^-1 = 0.37 < 0.5
    vetoed = correct([A, B], TrainConfig(rollout_token_veto_threshold=0.5))  # A has e^-1 < 0.5
    assert [r.rollout_id for r in vetoed.rows] == ["b"]
    assert vetoed.metrics["rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert vetoed.metrics["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_weights_in_the_advantages_are_weights_on_the_clipped_surrogate(clip_ratio_c):
    """verl multiplies each token's clipped (and dual-clipped) surrogate by its weight; the
    surrogate is positively homogeneous in the advantage, so the weight in the advantage gives the
    same loss and the same gradient."""
    generator = torch.Generator().manual_seed(0)
    log_probs = (torch.randn(3, 6, generator=generator) * 0.5).requires_grad_(True)
    old = torch.randn(3, 6, generator=generator) * 0.5
    advantages = torch.randn(3, 6, generator=generator)
    weights = torch.rand(3, 6, generator=generator) * 2
    mask = torch.ones(3, 6)
    verl = policy_loss(log_probs, old, advantages, mask, 0.2, 0.28, weights, clip_ratio_c=clip_ratio_c).loss
    (verl_grad,) = torch.autograd.grad(verl, log_probs)
    ours = policy_loss(log_probs, old, advantages * weights, mask, 0.2, 0.28, None, clip_ratio_c=clip_ratio_c).loss
    (our_grad,) = torch.autograd.grad(ours, log_probs)
    torch.testing.assert_close(ours, verl)
    torch.testing.assert_close(our_grad, verl_grad)


def test_the_train_steps_carry_the_iterations_metrics_and_truncated_is_reads_as_token_is():
    done = prepare([A, B], TrainConfig(rollout_is="token"))
    assert json.loads(json.dumps(done.metrics))["kl"] == pytest.approx(0.06)
    # a saved config of an earlier version: --truncated-is with its cap was the token level
    table = typed_layer(TrainConfig, {"truncated_is": True, "is_cap": 3.0, "lr": 1e-5})
    config = TrainConfig(**table)
    assert (config.rollout_is, config.rollout_is_threshold, config.lr) == ("token", 3.0, 1e-5)
    assert dataclasses.replace(config).rollout_is == "token"
