"""Rollout correction (engine/train/rollout_correction.py) as verl's rollout_corr_helper computes it
(v0.7.0, the reference's): worked by hand on two rows whose behaviour and recomputed log-probs
differ by known amounts, then on rows shaped as the warehouse's (multi-token prompts, tool spans
with loss_mask 0 inside the response, SAAR's per-token advantages) against verl's arithmetic
(tests/verl_rollout_corr.py, and verl itself where it is installed): every metric's name and value,
the rejection mask and the weights, for every setting."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from cleaner.config import TrainConfig
from cleaner.engine.train.rollout_correction import Corrected, correct
from cleaner.engine.train.step import iter_mini_batches, prepare
from cleaner.records import PurifiedRow
from tests import verl_rollout_corr as verl
from tests.factories import warehouse_row


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


def weights(done: Corrected, index: int) -> tuple[float, ...]:
    """The IS weights `correct` gave row `index` of its rows, per token (1 off its loss tokens)."""
    return done.is_weights[id(done.rows[index])]


def test_token_level_is_weights_truncate_and_go_to_the_loss_beside_the_advantages():
    done = correct([A, B], TrainConfig(rollout_is="token", rollout_is_threshold=1.2))
    assert done.rows == [A, B]  # advantages and masks as they were
    assert weights(done, 0) == pytest.approx((1.0, 1.2, math.exp(-1.0)))  # e^0.5 = 1.65 > 1.2
    assert weights(done, 1) == pytest.approx((1.0, 1.2, math.exp(0.1), math.exp(-0.1)))  # e^0.2 = 1.22 > 1.2
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
    assert weights(done, 0)[1:] == pytest.approx((wa / mean,) * 2)
    assert weights(done, 1)[1:] == pytest.approx((wb / mean,) * 3)
    assert done.metrics["rollout_is_batch_norm_factor"] == pytest.approx(mean)


@pytest.mark.parametrize(("level", "upper", "lower", "masks"), [
    # per token: A's e^0.5 = 1.65 is above, e^-1 = 0.37 below; B's 1.22, 1.11, 0.90 within
    ("token", 1.3, 0.5, {"a": [0, 0], "b": [1, 1, 1]}),
    # per row, the sum: A's e^-0.5 = 0.61 below, B's e^0.2 = 1.22 above: nothing left
    ("sequence", 1.1, 0.7, {"a": [0, 0], "b": [0, 0, 0]}),
    # per row, the mean: A's e^-0.25 = 0.78 and B's e^0.067 = 1.07 within
    ("geometric", 1.1, 0.6, {"a": [1, 1], "b": [1, 1, 1]}),
])
def test_rejection_sampling_by_token_sequence_and_geometric_mean(level, upper, lower, masks):
    done = correct([A, B], TrainConfig(rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower))
    # a row with nothing left stays, with a zero mask, as verl keeps it
    assert {r.rollout_id: list(r.loss_mask[1:]) for r in done.rows} == masks
    kept = sum(sum(mask) for mask in masks.values())
    assert done.metrics["rollout_rs_masked_fraction"] == pytest.approx(1 - kept / 5)


def test_the_lower_bound_defaults_to_one_over_the_upper_and_the_veto_rejects_a_row():
    done = correct([A, B], TrainConfig(rollout_rs="token", rollout_rs_threshold=2.0))  # [0.5, 2]
    a = next(r for r in done.rows if r.rollout_id == "a")
    assert a.loss_mask == (0, 1, 0)  # e^-1 = 0.37 < 0.5
    vetoed = correct([A, B], TrainConfig(rollout_token_veto_threshold=0.5))  # A has e^-1 < 0.5
    assert [r.loss_mask for r in vetoed.rows] == [(0, 0, 0), B.loss_mask]
    assert vetoed.metrics["rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert vetoed.metrics["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


def test_the_train_steps_carry_the_iterations_metrics():
    """(An earlier format's `truncated_is` reads as rollout_is token: tests/warehouse/test_format.py.)"""
    done = prepare([A, B], TrainConfig(rollout_is="token"))
    assert json.loads(json.dumps(done.metrics))["kl"] == pytest.approx(0.06)


# ---------------------------------------------------------------------------
# verl's metrics, by hand


def test_veto_metrics_are_zero_with_the_veto_off_and_rejections_metrics_appear_only_with_it_on():
    off = correct([A, B], TrainConfig()).metrics
    assert (off["rollout_is_veto_fraction"], off["rollout_is_catastrophic_token_fraction"]) == (0.0, 0.0)
    vetoed = correct([A, B], TrainConfig(rollout_token_veto_threshold=0.5)).metrics  # A's e^-1 < 0.5
    assert not any(key.startswith("rollout_rs") for key in vetoed)
    # with rejection too: its masked fractions are its own (B's e^0.2 above 1.2), not the veto's (A)
    both = correct([A, B], TrainConfig(rollout_rs="token", rollout_rs_threshold=1.2, rollout_rs_threshold_lower=0.1,
                                       rollout_token_veto_threshold=0.5)).metrics
    assert both["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)  # A's e^0.5 and B's e^0.2
    assert both["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert both["rollout_is_veto_fraction"] == pytest.approx(0.5)


def test_the_rows_mean_weights_have_the_sample_std():
    m = correct([A, B], TrainConfig(rollout_is="token", rollout_is_threshold=3.0)).metrics
    means = [(math.exp(0.5) + math.exp(-1.0)) / 2, (math.exp(0.2) + math.exp(0.1) + math.exp(-0.1)) / 3]
    assert m["rollout_is_seq_mean"] == pytest.approx(sum(means) / 2)
    assert m["rollout_is_seq_std"] == pytest.approx(abs(means[0] - means[1]) / math.sqrt(2))  # n - 1 = 1


def test_geometric_bounds_count_rows_and_sequence_bounds_are_unclamped():
    # geometric: A's mean -0.25 below log(0.9), B's 0.067 within: one row of two (tokens: 2 of 5)
    geometric = correct([A, B], TrainConfig(rollout_rs="geometric", rollout_rs_threshold=1.1,
                                            rollout_rs_threshold_lower=0.9)).metrics
    assert (geometric["rollout_rs_ratio_fraction_low"], geometric["rollout_rs_ratio_fraction_high"]) == (0.5, 0.0)
    assert geometric["rollout_rs_min"] == pytest.approx(math.exp(-0.25))
    # sequence: sums of -25 and +25, past the e^+-20 clamp: the min is e^-25, the max capped at e^20
    far = [row("lo", [-30.0, -5.0], [-5.0, -5.0], 1.0), row("hi", [-1.0, -1.0], [-26.0, -1.0], 1.0)]
    sequence = correct(far, TrainConfig(rollout_rs="sequence", rollout_rs_threshold=2.0)).metrics
    assert sequence["rollout_rs_min"] == pytest.approx(math.exp(-25), rel=1e-9)
    assert sequence["rollout_rs_max"] == pytest.approx(math.exp(20))
    weights = correct(far, TrainConfig(rollout_is="sequence")).metrics
    assert weights["rollout_is_min"] == pytest.approx(math.exp(-25), rel=1e-9)


def test_batch_normalisation_with_a_vanishing_mean_reports_factor_one_and_leaves_the_weights():
    # both rows' sums are below -20: each weight e^-20 = 2e-9, their mean under verl's 1e-8
    far = [row("x", [-30.0, -5.0], [-5.0, -5.0], 1.0), row("y", [-28.0], [-4.0], 2.0)]
    done = correct(far, TrainConfig(rollout_is="sequence", rollout_is_batch_normalize=True))
    assert done.metrics["rollout_is_batch_norm_factor"] == 1.0
    assert weights(done, 1)[1] == pytest.approx(math.exp(-20))


def test_a_row_without_loss_tokens_counts_in_the_metrics_as_verls_does():
    """verl's batch holds the row with a zero mask: its per-row means are 0 (0 / (0 + 1e-8)), its
    sequence ratio exp(0) = 1."""
    empty = dataclasses.replace(row("e", [-1.0], [-1.0], 0.0), loss_mask=(0, 0))
    m = correct([A, B, empty], TrainConfig(rollout_is="token", rollout_is_threshold=3.0)).metrics
    d = [(-1.5 - 1.0) / 2 - (-1.0 - 2.0) / 2, (-0.5 - 0.5 - 0.4) / 3 - (-0.3 - 0.4 - 0.5) / 3, 0.0]
    assert m["log_ppl_diff"] == pytest.approx(sum(d) / 3)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.4) + 1) / 3)
    assert m["chi2_seq"] == pytest.approx((math.exp(2 * -0.5) + math.exp(2 * 0.2) + 1) / 3 - 1)
    assert m["kl"] == pytest.approx(0.06)  # token means: the empty row adds no token
    assert m["rollout_is_seq_min"] == 0.0  # its mean weight
    assert correct([empty], TrainConfig()).metrics == {}  # no loss token at all: nothing to measure


# ---------------------------------------------------------------------------
# Warehouse-shaped rows: prompts, tool spans, SAAR's per-token advantages


def _shaped(log_ratios: list[float], spans=((4, 3), (5, 0)), token_advantages=None) -> PurifiedRow:
    """A warehouse-shaped row (6-token prompt, 4 trained tokens, a 3-token tool span, 5 trained
    tokens) whose loss tokens have these log-ratios."""
    base = warehouse_row("w", torch.Generator().manual_seed(0), spans=spans, per_token=False)
    old = list(base.behavior_logprobs)
    positions = [t for t, m in enumerate(base.loss_mask) if m]
    for position, log_ratio in zip(positions, log_ratios, strict=True):
        old[position] = base.behavior_logprobs[position] + log_ratio
    return dataclasses.replace(base, old_logprobs=tuple(old), token_advantages=token_advantages)


def test_the_geometric_mean_is_over_the_loss_tokens_only():
    """9 loss tokens of 18 (the prompt and the tool span are not): mean log-ratio 0.05, ratio 1.051 >
    1.04, rejected; over every position it would be 0.025 (1.025), kept."""
    shaped = _shaped([0.05] * 9)
    done = correct([shaped, A], TrainConfig(rollout_rs="geometric", rollout_rs_threshold=1.04,
                                            rollout_rs_threshold_lower=0.5))
    assert sum(done.rows[0].loss_mask) == 0
    assert done.metrics["rollout_rs_max"] == pytest.approx(math.exp(0.05))


def test_the_veto_sees_a_ratio_below_e_minus_20():
    shaped = _shaped([0.0] * 8 + [-25.0])  # below the e^-20 clamp
    done = correct([shaped, A], TrainConfig(rollout_token_veto_threshold=1e-10))  # log: -23.03
    assert sum(done.rows[0].loss_mask) == 0 and done.rows[1] == A
    assert done.metrics["rollout_is_veto_fraction"] == 0.5
    assert done.metrics["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 11)


def test_batch_normalisation_counts_the_rejected_tokens():
    """verl normalises the weights before rejection, over the original mask: the rejected token's
    truncated weight (2.0) is in the mean."""
    log_ratios = [0.0] * 8 + [1.0]  # e^1 = 2.72 > 2: rejected (token level), truncated to 2 as a weight
    done = correct([_shaped(log_ratios)], TrainConfig(rollout_is="token", rollout_is_batch_normalize=True,
                                                      rollout_rs="token", rollout_rs_threshold=2.0))
    mean = (8 * 1.0 + 2.0) / 9
    assert done.metrics["rollout_is_batch_norm_factor"] == pytest.approx(mean)
    shaped = done.rows[0]
    trained = [t for t, m in enumerate(shaped.loss_mask) if m]
    assert len(trained) == 8
    assert [weights(done, 0)[t] for t in trained] == pytest.approx([1 / mean] * 8)


def test_is_weights_sit_at_the_loss_tokens_and_leave_saars_per_token_advantages():
    pushes = tuple(0.1 * t for t in range(18))  # SAAR's per-token advantages
    log_ratios = [0.1 * k - 0.4 for k in range(9)]
    done = correct([_shaped(log_ratios, token_advantages=pushes)], TrainConfig(rollout_is="token"))
    positions = [t for t, m in enumerate(done.rows[0].loss_mask) if m]
    assert [weights(done, 0)[t] for t in positions] == pytest.approx([math.exp(x) for x in log_ratios])
    assert weights(done, 0)[:6] + weights(done, 0)[10:13] == (1.0,) * 9  # the prompt and the tool span
    assert done.rows[0].token_advantages == pushes


# ---------------------------------------------------------------------------
# Against verl's arithmetic: seeded warehouse batches x every setting

SETTINGS = [
    {},
    {"rollout_is": "token"},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence"},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True},
    {"rollout_rs": "token", "rollout_rs_threshold": 2.0},
    {"rollout_rs": "token", "rollout_rs_threshold": 1.5, "rollout_rs_threshold_lower": 0.8},
    {"rollout_rs": "sequence", "rollout_rs_threshold": 3.0},
    {"rollout_rs": "geometric", "rollout_rs_threshold": 1.1},
    {"rollout_rs": "geometric", "rollout_rs_threshold": 1.001},
    {"rollout_token_veto_threshold": 1e-4},
    {"rollout_token_veto_threshold": 1e-10},
    {"rollout_is": "token", "rollout_is_batch_normalize": True, "rollout_rs": "token", "rollout_rs_threshold": 1.2,
     "rollout_token_veto_threshold": 1e-4},
    {"rollout_is": "sequence", "rollout_is_batch_normalize": True, "rollout_rs": "geometric",
     "rollout_rs_threshold": 1.05},
    {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 0.5,
     "rollout_token_veto_threshold": 1e-10},
    {"rollout_is": "token", "rollout_is_batch_normalize": True, "rollout_rs": "geometric", "rollout_rs_threshold": 1.001},
]
VERL_NAMES = {"rollout_is": "is_level", "rollout_is_threshold": "is_threshold", "rollout_rs": "rs_level",
              "rollout_rs_threshold": "rs_threshold", "rollout_rs_threshold_lower": "rs_threshold_lower",
              "rollout_token_veto_threshold": "veto_threshold", "rollout_is_batch_normalize": "batch_normalize"}


def _warehouse_batch(seed: int) -> list[PurifiedRow]:
    """Rows of several shapes and spreads, a row without loss tokens, and every other batch a
    token with log-ratio -25 (below the e^-20 clamp)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(7):
        lengths = torch.randint(1, 9, (3,), generator=generator).tolist()
        spans = ((lengths[0], lengths[1]), (lengths[2], int(index % 2)))
        spread = (0.02, 0.3, 1.0)[(seed + index) % 3]
        rows.append(warehouse_row(f"r{index}", generator, spread, prompt_len=2 + index, spans=spans,
                                  per_token=index % 2 == 0))
    rows.append(warehouse_row("empty", generator, spans=((0, 4),)))
    if seed % 2:
        first = rows[0]
        position = first.loss_mask.index(1)
        old = list(first.old_logprobs)
        old[position] = first.behavior_logprobs[position] - 25.0
        rows[0] = dataclasses.replace(first, old_logprobs=tuple(old))
    return rows


ORACLES = [verl.correction_and_rejection_mask]
if verl.verl_helper() is not None:  # tools/verl-reference/setup.sh's environment
    ORACLES.append(lambda batch, **settings: verl.verl_own(verl.verl_helper(), batch, **settings))


@pytest.mark.parametrize("oracle", ORACLES, ids=["transcribed", "verl"][: len(ORACLES)])
@pytest.mark.parametrize("settings", SETTINGS, ids=[",".join(f"{k}={v}" for k, v in s.items()) or "off" for s in SETTINGS])
def test_every_metric_the_masks_and_the_weights_equal_verls(settings, oracle):
    config = TrainConfig(**settings)
    for seed in range(10):
        rows = _warehouse_batch(seed)
        done = correct(rows, config)
        verl_weights, mask, metrics = oracle(verl.verl_batch(rows), **{VERL_NAMES[k]: v for k, v in settings.items()})
        assert done.metrics.keys() == metrics.keys(), seed
        for name, value in metrics.items():
            assert done.metrics[name] == pytest.approx(value, rel=2e-5, abs=1e-6), (seed, name)
        assert [r.rollout_id for r in done.rows] == [r.rollout_id for r in rows]  # every row stays
        for index, (before, after) in enumerate(zip(rows, done.rows, strict=True)):
            response = slice(before.prompt_len, None)
            assert list(after.loss_mask[response]) == mask[index, : len(before.token_ids) - before.prompt_len].tolist()
            assert after.token_advantages == before.token_advantages
            if verl_weights is None:
                assert done.is_weights == {}
                continue
            expected = [w if m else 1.0 for w, m in zip(verl_weights[index].tolist(), before.loss_mask[response],
                                                         strict=False)]
            assert list(done.is_weights[id(after)][response]) == pytest.approx(expected, rel=2e-5, abs=1e-7), (seed, index)


def test_heavy_rejection_keeps_verls_mini_batches():
    """Geometric 1.001 empties nearly every row; the rows stay, so the mini batches (and the
    optimiser steps) are those of the batch before rejection."""
    rows = [r for seed in range(3) for r in _warehouse_batch(seed)]
    rows = [dataclasses.replace(r, rollout_id=f"{r.rollout_id}-{i}") for i, r in enumerate(rows)]
    config = TrainConfig(rollout_rs="geometric", rollout_rs_threshold=1.001, mini_batch_size=4, micro_batch_size=2)
    done = prepare(rows, config)
    assert sum(1 for r in done.rows if sum(r.loss_mask) == 0) >= len(rows) - 6  # nearly all rejected
    before = [[r.rollout_id for r in mini] for mini in iter_mini_batches(rows, config, 0)]
    after = [[r.rollout_id for r in mini] for mini in iter_mini_batches(done.rows, config, 0)]
    assert after == before and len(after) == math.ceil(len(rows) / 4)


# ---------------------------------------------------------------------------
# Edges verl's code decides (found by `make mutants`: docs/mutants.md)


def _flat(log_ratios: list[float], rollout_id: str = "f") -> PurifiedRow:
    """A row whose loss tokens have these exact log-ratios (behaviour 0, old = the log-ratio)."""
    return row(rollout_id, log_ratios, [0.0] * len(log_ratios), 1.0)


def test_bounds_are_strict_for_the_fractions_and_inclusive_for_keeping():
    """Ratios exactly at a bound: verl's `>` and `<` count none of them high or low, its `>=` and
    `<=` keep them all (threshold 1: upper = lower = 1, every log-ratio exactly 0)."""
    rows = [_flat([0.0, 0.0]), _flat([0.0], "g")]
    for level in ("token", "sequence", "geometric"):
        done = correct(rows, TrainConfig(rollout_rs=level, rollout_rs_threshold=1.0))
        m = done.metrics
        assert [r.loss_mask for r in done.rows] == [r.loss_mask for r in rows], level
        assert (m["rollout_rs_ratio_fraction_high"], m["rollout_rs_ratio_fraction_low"]) == (0.0, 0.0), level
        assert (m["rollout_rs_seq_fraction_high"], m["rollout_rs_seq_fraction_low"]) == (0.0, 0.0), level
        assert (m["rollout_rs_masked_fraction"], m["rollout_rs_seq_masked_fraction"]) == (0.0, 0.0), level
    at_floor = correct([_flat([math.log(0.5)])], TrainConfig(rollout_token_veto_threshold=0.5))
    assert at_floor.rows[0].loss_mask == (0, 1)  # log-ratio == log(threshold): not below it
    assert at_floor.metrics["rollout_is_catastrophic_token_fraction"] == 0.0


def test_ratios_are_clamped_at_e20_above_too():
    far = correct([_flat([25.0, 0.0])], TrainConfig(rollout_is="token", rollout_is_threshold=3.0))
    assert far.metrics["rollout_is_max"] == pytest.approx(math.exp(20))
    assert far.metrics["chi2_token"] == pytest.approx((math.exp(40) + 1) / 2 - 1)
    assert far.metrics["chi2_seq"] == pytest.approx(math.exp(40) - 1)  # the sum 25, clamped at 20


def test_one_token_or_one_row_has_no_spread():
    one = correct([_flat([0.3])], TrainConfig(rollout_is="token", rollout_is_threshold=3.0)).metrics
    assert (one["rollout_is_std"], one["rollout_is_seq_std"]) == (0.0, 0.0)
    two = correct([_flat([0.3, -0.3])], TrainConfig(rollout_is="token", rollout_is_threshold=3.0)).metrics
    assert two["rollout_is_std"] == pytest.approx((math.exp(0.3) - math.exp(-0.3)) / 2)  # population, over tokens
    assert two["rollout_is_seq_std"] == 0.0


def test_the_effective_sample_size_carries_verls_epsilon():
    m = correct([A, B], TrainConfig(rollout_is="token", rollout_is_threshold=3.0)).metrics
    weights = [math.exp(x) for x in [0.5, -1.0, 0.2, 0.1, -0.1]]  # all within [1/3, 3]
    mean = sum(weights) / 5
    assert m["rollout_is_eff_sample_size"] == pytest.approx(
        1 / (sum((w / (mean + 1e-8)) ** 2 for w in weights) / 5), rel=1e-12)


def test_sequence_normalisation_takes_one_weight_per_row_and_a_mean_at_the_floor_is_kept():
    short = _flat([0.4], "s")  # one token: weight e^0.4; A's sum -0.5: e^-0.5 on two tokens
    done = correct([A, short], TrainConfig(rollout_is="sequence", rollout_is_batch_normalize=True))
    assert done.metrics["rollout_is_batch_norm_factor"] == pytest.approx((math.exp(-0.5) + math.exp(0.4)) / 2)
    # every weight truncated to 1e-8: their mean is exactly verl's floor, so nothing is divided
    floor = correct([A], TrainConfig(rollout_is="token", rollout_is_threshold=1e-8, rollout_is_batch_normalize=True))
    assert floor.metrics["rollout_is_batch_norm_factor"] == 1.0
    assert weights(floor, 0)[1:] == (1e-8, 1e-8)


def test_a_batch_without_loss_tokens_is_returned_as_it_is():
    empty = dataclasses.replace(_flat([0.1]), loss_mask=(0, 0))
    assert correct([empty], TrainConfig(rollout_rs="token", rollout_rs_threshold=2.0)) == Corrected([empty], {})
