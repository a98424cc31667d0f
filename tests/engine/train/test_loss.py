"""Loss math against hand-computed values (cleaner/engine/train/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from cleaner.config import LossMode
from cleaner.engine.train.aggregation import BatchTotals, Rows
from cleaner.engine.train.loss import (
    POLICY_LOSSES,
    Clip,
    Surrogate,
    cispo,
    dynamic_sampling_mask,
    entropy_from_logits,
    geo_mean,
    gspo,
    k3_kl,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    token_log_probs,
    vanilla,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _log(values):
    return torch.log(torch.tensor(values, dtype=torch.float32))


# ---------------------------------------------------------------------------
# Elementary pieces


def test_token_log_probs_are_aligned_with_the_predicted_token():
    # Logits at position t predict token t+1: [0, 0] -> p = 1/2 each; [ln 3, 0] -> p(1) = 1/4.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])  # (1, 3, 2)
    token_ids = torch.tensor([[0, 0, 1]])
    result = token_log_probs(logits, token_ids)
    assert result.shape == (1, 3)
    assert result[0].tolist() == pytest.approx([0.0, math.log(0.5), math.log(0.25)], abs=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [1.0, 2.0]]])
    expected = [0.0, math.log(2.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------
# Policy loss


def test_asymmetric_clip_on_both_sides():
    # One row, four loss tokens, per-token advantages.
    ratios = [1.5, 0.5, 1.25, 0.75]
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    old = torch.zeros(1, 4)
    log_probs = _log([ratios]).requires_grad_(True)
    out = policy_loss(log_probs, old, advantages, torch.ones(1, 4), EPS_LOW, EPS_HIGH)
    # t0: A>0, 1.5 > 1.28 -> clipped to 1.28.   t1: A<0, 0.5 < 0.8 -> clipped to 0.8.
    # t2: A>0, 1.25 < 1.28 -> NOT clipped (it would be with a symmetric 0.2).
    # t3: A<0, 0.75 < 0.8 -> clipped (it would not be with a symmetric 0.28).
    expected = (-1.28 + 0.8 - 1.25 + 0.8) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(3 / 4)
    out.loss.backward()
    # d(-ratio * A / 4)/d log_prob = -ratio * A / 4 on the unclipped token; 0 on clipped ones.
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.25 / 4, 0.0], abs=1e-6)


def test_pessimistic_side_is_not_clipped():
    # A<0 with a ratio above 1 + eps_high: min picks the unclipped (worse) term, gradient flows.
    log_probs = _log([[1.5]]).requires_grad_(True)
    out = policy_loss(
        log_probs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), EPS_LOW, EPS_HIGH
    )
    assert out.loss.item() == pytest.approx(1.5)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    assert log_probs.grad.item() == pytest.approx(1.5)


def test_dual_clip_caps_negative_advantage_tokens():
    # Ratios 5 and 1.5 with A = -1 and c = 3: the first is capped at -A*c = 3 (no gradient), the
    # second stays 1.5 (gradient 1.5); a positive-advantage token is untouched by the dual clip.
    log_probs = _log([[5.0, 1.5]]).requires_grad_(True)
    out = policy_loss(log_probs, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2),
                      EPS_LOW, EPS_HIGH, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx((3.0 + 1.5) / 2)
    out.loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, 1.5 / 2])
    positive = policy_loss(_log([[5.0]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                           EPS_LOW, EPS_HIGH, clip_ratio_c=3.0)
    assert positive.loss.item() == pytest.approx(-(1.0 + EPS_HIGH))


def test_token_mean_over_all_loss_tokens_of_the_batch():
    # Row 0 has 1 loss token (A = 2), row 1 has 3 (A = -1); ratios are 1.
    loss_mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]])
    zeros = torch.zeros(2, 4)
    out = policy_loss(zeros, zeros, torch.tensor([2.0, -1.0]), loss_mask, EPS_LOW, EPS_HIGH)
    assert out.loss.item() == pytest.approx(
        (-2.0 + 3 * 1.0) / 4
    )  # not the mean of row means (-0.5)
    assert out.approx_kl.item() == pytest.approx(0.0)
    # An explicit denominator (the mini batch's total) replaces the local count.
    scaled = policy_loss(
        zeros, zeros, torch.tensor([2.0, -1.0]), loss_mask, EPS_LOW, EPS_HIGH, num_loss_tokens=8
    )
    assert scaled.loss.item() == pytest.approx(1.0 / 8)


def test_masked_tokens_contribute_nothing():
    loss_mask = torch.tensor([[0, 1, 1, 0]])
    old = _log([[0.3, 0.5, 0.2, 0.4]])
    advantages = torch.tensor([1.5])

    def loss_and_grad(masked_values):
        log_probs = _log([[masked_values[0], 0.6, 0.1, masked_values[1]]]).requires_grad_(True)
        out = policy_loss(log_probs, old, advantages, loss_mask, EPS_LOW, EPS_HIGH)
        out.loss.backward()
        return out.loss.item(), log_probs.grad.clone()

    loss_a, grad_a = loss_and_grad((0.9, 0.01))
    loss_b, grad_b = loss_and_grad((1e-6, 0.99))
    assert loss_a == loss_b
    assert torch.equal(grad_a, grad_b)
    assert grad_a[0, 0].item() == 0.0 and grad_a[0, 3].item() == 0.0
    # Token 1: ratio 1.2 <= 1.28, unclipped: -A * ratio / 2.  Token 2: ratio 0.5, A > 0, unclipped.
    assert grad_a[0, 1].item() == pytest.approx(-1.5 * 1.2 / 2, abs=1e-6)
    assert grad_a[0, 2].item() == pytest.approx(-1.5 * 0.5 / 2, abs=1e-6)


def test_zero_advantage_gives_zero_gradient():
    log_probs = _log([[0.2, 0.7, 0.9]]).requires_grad_(True)
    old = _log([[0.3, 0.3, 0.3]])
    out = policy_loss(log_probs, old, torch.tensor([0.0]), torch.ones(1, 3), EPS_LOW, EPS_HIGH)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(log_probs.grad) == 0


def test_is_weights_multiply_the_surrogate():
    log_probs = torch.zeros(1, 2, requires_grad=True)
    out = policy_loss(
        log_probs,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        EPS_LOW,
        EPS_HIGH,
        is_weights=torch.tensor([[2.0, 0.5]]),
    )
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)


def test_approx_kl_is_k3_of_the_ratio():
    # log ratio = ln 2: k3 = exp(-ln 2) - 1 + ln 2 = 0.5 - 1 + 0.693147.
    out = policy_loss(
        _log([[2.0]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), EPS_LOW, EPS_HIGH
    )
    assert out.approx_kl.item() == pytest.approx(0.5 - 1 + math.log(2.0), abs=1e-6)


# ---------------------------------------------------------------------------
# KL, importance sampling, batch shaping


def test_kl_penalty_k3():
    log_probs = _log([[0.5, 0.5, 0.9]])
    ref = _log([[0.25, 0.5, 0.1]])
    mask = torch.tensor([[1, 1, 0]])
    # Token 0: exp(ln .5) - ln .5 - 1 = 0.193147; token 1: 0; token 2 masked.
    expected = (0.5 - math.log(0.5) - 1.0) / 2
    assert kl_penalty(log_probs, ref, mask).item() == pytest.approx(expected, abs=1e-6)


def test_k3_is_clamped_as_verls_low_var_kl():
    """ref - lp = 10 gives exp(10) - 11 = 22015.5 unclamped and ref - lp = 100 gives inf; verl's
    low_var_kl clamps the log-ratio to [-20, 20] and the value to 10. Small values are untouched."""
    log_probs = torch.tensor([[-10.0, -100.0, -1.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0, -1.5, -30.0]])
    per_token = [10.0, 10.0, math.exp(-0.5) + 0.5 - 1.0, 10.0]  # the last: -20 -> e^-20 + 20 - 1 -> 10
    for t, expected in enumerate(per_token):
        mask = torch.zeros(1, 4)
        mask[0, t] = 1.0
        assert kl_penalty(log_probs, ref, mask).item() == pytest.approx(expected, abs=1e-6)
    assert kl_penalty(log_probs, ref, torch.ones(1, 4)).item() == pytest.approx(sum(per_token) / 4, abs=1e-6)
    assert k3_kl(torch.tensor([math.log(2.0)])).item() == pytest.approx(2.0 - math.log(2.0) - 1.0)


def test_approx_kl_metric_is_clamped_too():
    # a token whose probability rose e^15-fold: unclamped k3 of old - new = e^-15 + 15 - 1 = 14
    out = policy_loss(torch.tensor([[15.0]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                      EPS_LOW, EPS_HIGH)
    assert out.approx_kl.item() == pytest.approx(10.0)


def test_dynamic_sampling_drops_equal_reward_groups():
    group_ids = ["a", "a", "b", "b", "c", "c", "d"]
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    keep = dynamic_sampling_mask(group_ids, rewards)
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty():
    lengths = torch.tensor([5, 6, 8, 10, 12])
    # max 10, buffer 4: no penalty up to 6, linear to -1 at 10, -1 beyond.
    assert overlong_penalty(lengths, max_len=10, buffer=4).tolist() == pytest.approx(
        [0.0, 0.0, -0.5, -1.0, -1.0]
    )
    assert overlong_penalty(lengths, max_len=10, buffer=0).tolist() == [0.0] * 5




# ---------------------------------------------------------------------------
# Edges found by `make mutants` (docs/mutants.md)


def test_entropy_is_over_the_vocabulary_of_each_position():
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))  # (B, T, V)
    expected = torch.distributions.Categorical(logits=logits[:, :-1]).entropy()  # (B, T-1)
    torch.testing.assert_close(entropy_from_logits(logits)[:, 1:], expected)
    assert entropy_from_logits(logits)[:, 0].tolist() == [0.0, 0.0]


def test_kl_penalty_takes_the_mini_batch_denominator_and_ignores_masked_garbage():
    log_probs = torch.tensor([[math.log(0.5), float("nan")]])  # a masked position holding nan
    ref = torch.tensor([[math.log(0.25), 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    one = 0.5 - math.log(0.5) - 1.0
    assert kl_penalty(log_probs, ref, mask).item() == pytest.approx(one)
    assert kl_penalty(log_probs, ref, mask, num_loss_tokens=4).item() == pytest.approx(one / 4)


def test_dynamic_sampling_keeps_a_group_just_above_its_tolerance():
    # rewards 1e-9 apart: verl's check is strictly greater than the tolerance; 2e-9 apart: kept
    keep = dynamic_sampling_mask(["a", "a", "b", "b"], torch.tensor([0.0, 1e-9, 0.0, 2e-9], dtype=torch.float64))
    assert keep.tolist() == [False, False, True, True]


def test_an_overlong_buffer_of_one_token_still_penalises():
    # max 10, buffer 1: 9 tokens free, -1 at 10 and beyond
    assert overlong_penalty(torch.tensor([9, 10, 11]), max_len=10, buffer=1).tolist() == pytest.approx(
        [0.0, -1.0, -1.0])


def test_the_ratio_is_clamped_at_e_plus_minus_20_and_masked_garbage_is_ignored():
    # no dual clip: a negative advantage takes the unclipped ratio, a positive one the small ratio
    up = policy_loss(torch.tensor([[25.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                     EPS_LOW, EPS_HIGH)
    assert up.loss.item() == pytest.approx(math.exp(20), rel=1e-6)
    down = policy_loss(torch.tensor([[-25.0]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                       EPS_LOW, EPS_HIGH)
    assert down.loss.item() == pytest.approx(-math.exp(-20), abs=1e-12)
    garbage = policy_loss(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), torch.tensor([1.0]),
                          torch.tensor([[1.0, 0.0]]), EPS_LOW, EPS_HIGH)
    assert garbage.loss.item() == -1.0
    # nor its gradient: an old log-prob of nan at a masked position leaves every gradient finite
    log_probs = torch.zeros(1, 2, requires_grad=True)
    for loss_mode in POLICY_LOSSES.values():
        mask = torch.tensor([[1.0, 0.0]])
        surrogate = Surrogate(log_probs, torch.tensor([[0.0, float("nan")]]), torch.ones(1, 2), Rows.padded(mask))
        (grad,) = torch.autograd.grad(loss_mode(surrogate, CLIP, "token-mean", ONE_ROW).loss, log_probs)
        assert torch.isfinite(grad).all() and grad[0, 1] == 0.0, loss_mode.__name__


def test_the_clip_fraction_counts_only_clipped_gradients_of_loss_tokens():
    """Ratios exactly at the bounds (eps 0: both bounds 1) are not clipped; a zero advantage has no
    gradient to clip; a positive one below 1 - eps keeps its (unclipped) gradient; a masked token
    counts nowhere."""
    log_probs = _log([[1.0, 1.0, 2.0, 0.5, 0.5, 2.0]])
    advantages = torch.tensor([[1.0, -1.0, 0.0, 0.0, 0.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    out = policy_loss(log_probs, torch.zeros(1, 6), advantages, mask, 0.0, 0.0)
    assert out.clip_fraction.item() == 0.0
    clipped = policy_loss(log_probs, torch.zeros(1, 6), advantages, mask, 0.0, 0.5)  # 2.0 > 1.5 with A 0: no
    assert clipped.clip_fraction.item() == 0.0


def test_one_loss_token_is_its_own_denominator_and_approx_kl_is_a_mean():
    out = policy_loss(_log([[2.0]]), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), EPS_LOW, EPS_HIGH,
                      num_loss_tokens=1)
    assert out.loss.item() == pytest.approx(-(1 + EPS_HIGH))
    two = policy_loss(_log([[2.0, 1.0]]), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), EPS_LOW,
                      EPS_HIGH)
    assert two.approx_kl.item() == pytest.approx((0.5 - 1 + math.log(2.0)) / 2, abs=1e-6)


# ---------------------------------------------------------------------------
# The other loss modes by hand (verl's core_algos.py; against verl itself: test_objectives.py)


def _one_row(log_ratios, advantage, weights=None, dtype=torch.float64):
    """A one-row surrogate whose loss tokens have these log pi - log pi_old (pi_old = -1 each)."""
    old = torch.full((len(log_ratios),), -1.0, dtype=dtype)
    log_probs = (old + torch.tensor(log_ratios, dtype=dtype)).requires_grad_(True)
    mask = torch.ones(len(log_ratios), dtype=dtype)
    rows = Rows(index=torch.zeros(len(log_ratios), dtype=torch.int64), count=1, mask=mask)
    advantages = torch.full_like(old, advantage)
    weights = None if weights is None else torch.tensor(weights, dtype=dtype)
    return log_probs, Surrogate(log_probs, old, advantages, rows, weights)


ONE_ROW = BatchTotals(loss_tokens=2, rows=1)
CLIP = Clip(EPS_LOW, EPS_HIGH)


def test_gspo_gives_every_token_its_rows_geometric_mean_ratio():
    """log-ratios 0.1 and 0.3: the row's ratio e^0.2 = 1.22 (within [0.8, 1.28]) on both tokens,
    each token's gradient only through its own log-probability; seq-mean-token-mean over one row."""
    log_probs, surrogate = _one_row([0.1, 0.3], 1.0)
    out = gspo(surrogate, CLIP, "token-mean", ONE_ROW)  # the mode is verl's forced one, not this
    tokens = 2 + 1e-8  # verl's guard of the row's token count
    assert out.loss.item() == pytest.approx(-2 * math.exp(0.2) / tokens, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    assert grad.tolist() == pytest.approx([-math.exp(0.2) / tokens] * 2, rel=1e-12)
    assert (out.clip_fraction.item(), out.clip_fraction_lower.item()) == (0.0, 0.0)
    assert out.ppo_kl.item() == pytest.approx(-0.2, rel=1e-12)  # mean of log pi_old - log pi
    clipped = gspo(_one_row([0.3, 0.5], 1.0)[1], CLIP, "token-mean", ONE_ROW)  # e^0.4 = 1.49 > 1.28
    assert clipped.loss.item() == pytest.approx(-1.28 * 2 / tokens, rel=1e-12) and clipped.clip_fraction.item() == 1.0
    huge = gspo(_one_row([12.0, 12.0], -1.0)[1], Clip(0.2, 100.0), "token-mean", ONE_ROW)
    assert huge.loss.item() == pytest.approx(2 * math.exp(10.0) / tokens, rel=1e-12)  # clamped at e^10 in log space
    # a negative advantage below the lower bound (e^-0.5 = 0.61 < 0.8): the clipped 0.8, no gradient
    log_probs, surrogate = _one_row([-0.5, -0.5], -1.0)
    low = gspo(surrogate, CLIP, "token-mean", ONE_ROW)
    assert low.loss.item() == pytest.approx(2 * 0.8 / tokens, rel=1e-12) and low.clip_fraction.item() == 1.0
    assert torch.autograd.grad(low.loss, log_probs)[0].tolist() == [0.0, 0.0]


def test_cispo_keeps_the_gradient_of_a_clipped_token_at_the_clipped_weight():
    """log-ratio 0.5: the ratio e^0.5 = 1.65 clipped to 1.28 and stopped; the loss -1.28 A log pi
    keeps its gradient -1.28 A where vanilla's clip would remove it."""
    log_probs, surrogate = _one_row([0.5, 0.0], 2.0)
    out = cispo(surrogate, CLIP, "token-mean", ONE_ROW)
    assert out.loss.item() == pytest.approx((-1.28 * 2 * -0.5 + -1.0 * 2 * -1.0) / 2, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    assert grad.tolist() == pytest.approx([-1.28 * 2 / 2, -1.0 * 2 / 2], rel=1e-12)
    assert out.clip_fraction.item() == 0.5 and out.clip_fraction_lower.item() == 0.0
    weighted = cispo(_one_row([0.5, 0.0], 2.0, weights=[0.5, 2.0])[1], CLIP, "token-mean", ONE_ROW)
    assert weighted.loss.item() == pytest.approx((-1.28 * 2 * -0.5 * 0.5 + 2 * 2.0) / 2, rel=1e-12)
    # its ppo_kl reads the log-ratio clamped to +-20, as verl's: -20 and +20 average to 0
    assert cispo(_one_row([25.0, -25.0], 1.0)[1], CLIP, "token-mean", ONE_ROW).ppo_kl.item() == 0.0


def test_geo_mean_clips_each_log_ratio_on_the_side_its_advantage_grows():
    """log-ratios 0.1 and 0.5 clipped to [-0.2, 0.28]: a positive advantage keeps 0.1 and 0.28
    (ratio e^0.19), a negative one keeps both (e^0.3: growing the ratio is what it punishes)."""
    tokens = 2 + 1e-8  # verl's guard of the row's token count, in the mean advantage too
    up = geo_mean(_one_row([0.1, 0.5], 1.0)[1], CLIP, "token-mean", ONE_ROW)
    assert up.loss.item() == pytest.approx(-2 / tokens * math.exp((0.1 + 0.28) / tokens), rel=1e-12)
    assert (up.clip_fraction.item(), up.clip_fraction_lower.item()) == (0.5, 0.0)
    down = geo_mean(_one_row([0.1, 0.5], -1.0)[1], CLIP, "token-mean", ONE_ROW)
    assert down.loss.item() == pytest.approx(2 / tokens * math.exp(0.6 / tokens), rel=1e-12)
    assert (down.clip_fraction.item(), down.clip_fraction_lower.item()) == (0.0, 0.5)
    # a zero advantage counts in neither clip fraction, as verl's strict signs
    zero = geo_mean(_one_row([0.1, 0.5], 0.0)[1], CLIP, "token-mean", ONE_ROW)
    assert (zero.clip_fraction.item(), zero.clip_fraction_lower.item(), zero.loss.item()) == (0.0, 0.0, 0.0)
    # the IS weights enter as their geometric mean over the row; the row mean is over the mini batch's rows
    weighted = geo_mean(_one_row([0.1, 0.5], 1.0, weights=[0.5, 2.0])[1], CLIP, "token-mean",
                        BatchTotals(loss_tokens=2, rows=4))
    geometric = math.exp((math.log(0.5 + 1e-10) + math.log(2.0 + 1e-10)) / tokens)
    assert weighted.loss.item() == pytest.approx(-2 / tokens * math.exp(0.38 / tokens) * geometric / 4, rel=1e-12)


def test_vanillas_lower_clip_fraction_counts_the_dual_clips_negative_advantages():
    """ratio e^2 = 7.4 with A = -1: the clipped surrogate 7.4 is capped at c = 3 (the dual clip);
    with A = +1 nothing is capped; off, nothing is."""
    capped = vanilla(_one_row([2.0, 0.0], -1.0)[1], Clip(EPS_LOW, EPS_HIGH, 3.0), "token-mean", ONE_ROW)
    assert capped.loss.item() == pytest.approx((3.0 + 1.0) / 2, rel=1e-12)
    assert capped.clip_fraction_lower.item() == 0.5
    assert vanilla(_one_row([2.0, 0.0], 1.0)[1], Clip(EPS_LOW, EPS_HIGH, 3.0), "token-mean",
                   ONE_ROW).clip_fraction_lower.item() == 0.0
    # a loss exactly at the cap is not capped (verl's strict >): ratio e^0.5 with c = e^0.5
    at_cap = torch.exp(torch.tensor(0.5, dtype=torch.float64)).item()
    assert vanilla(_one_row([0.5], -1.0)[1], Clip(EPS_LOW, EPS_HIGH, at_cap), "token-mean",
                   BatchTotals(loss_tokens=1, rows=1)).clip_fraction_lower.item() == 0.0
    off = vanilla(_one_row([2.0, 0.0], -1.0)[1], CLIP, "token-mean", ONE_ROW)
    assert off.loss.item() == pytest.approx((math.exp(2.0) + 1.0) / 2, rel=1e-12)
    assert off.clip_fraction_lower.item() == 0.0
    assert capped.approx_kl.item() == pytest.approx((math.exp(-2.0) + 2.0 - 1.0) / 2, rel=1e-12)  # k3 of -2, 0
    assert capped.ppo_kl.item() == pytest.approx(-1.0, rel=1e-12)


def test_the_kl_penalty_of_one_loss_token_is_divided_by_one():
    log_probs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    k3 = math.exp(-0.5) + 0.5 - 1
    assert kl_penalty(log_probs, ref, torch.tensor([[1.0, 0.0]]), num_loss_tokens=1).item() == pytest.approx(k3, rel=1e-6)


def test_every_loss_mode_has_its_function():
    assert set(POLICY_LOSSES) == set(LossMode)
