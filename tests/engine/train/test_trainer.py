"""The training iteration on a tiny random Qwen3 (cleaner/engine/train/trainer.py, step.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.purify.advantages import advantages
from cleaner.engine.train.naive import collate_rows
from cleaner.engine.train.packing import pack_rows
from cleaner.engine.train.policy import TrainablePolicy
from cleaner.engine.train.step import (
    batch_totals,
    forward_micro_batch,
    iter_mini_batches,
    prepare_rows,
)
from cleaner.engine.train.trainer import train_iteration
from tests.factories import train_batch, train_row


def _batch_loss(model, rows, config):
    total = batch_totals(rows, config)
    with torch.no_grad():
        return forward_micro_batch(TrainablePolicy(model, config), None, rows, pack_rows(rows), config, total).loss.item()


# ---------------------------------------------------------------------------
# Training


def test_one_step_lowers_the_loss_and_saves_a_loadable_checkpoint(policy_dir, tmp_path):
    model = load_policy(policy_dir)
    rows = train_batch(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2)
    loss_before = _batch_loss(model, rows, config)
    result = train_iteration(
        rows, policy_dir, tmp_path / "out", config, iteration=3, progress=False
    )

    assert len(result.steps) == 1
    step = result.steps[0]
    assert (step.iteration, step.step, step.tokens) == (3, 0, 5 + 8 + 4 + 7)
    for value in (
        step.loss,
        step.clip_fraction,
        step.approx_kl,
        step.entropy,
        step.grad_norm,
        step.lr,
    ):
        assert math.isfinite(value)
    assert step.lr == 1e-2 and step.grad_norm > 0 and step.entropy > 0
    # Ratios are 1 at the start: loss = -sum(A * tokens) / N = -(5 - 8 + 4 - 7) / 24.
    assert step.loss == pytest.approx(6 / 24, abs=1e-5)
    assert step.clip_fraction == 0.0 and step.approx_kl == pytest.approx(0.0, abs=1e-6)

    changed = [
        name for name, p in result.model.named_parameters() if not torch.equal(p, before[name])
    ]
    assert changed
    loaded = load_policy(result.out_path)
    for (name, p), (_, q) in zip(
        result.model.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    assert (result.out_path / "train_config.json").exists()
    assert _batch_loss(loaded, rows, config) < loss_before


def test_each_steps_row_holds_the_policy_loss_apart_from_the_kl_and_entropy_terms(policy_dir, tmp_path):
    """verl's actor/pg_loss, kl_loss and entropy: loss = pg_loss + kl_coef kl_loss - entropy_coef
    entropy; without a KL term kl_loss is null, as verl logs none. At ratio 1 the metrics vanish."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    terms = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=1, kl_coef=0.5, entropy_coef=0.25,
                        loss_agg_mode="seq-mean-token-mean")
    steps = train_iteration(rows, policy_dir, tmp_path / "a", terms, iteration=0, progress=False).steps
    assert len(steps) == 2 and steps[1].kl_loss > 0  # the second step's policy has moved from the reference
    for step in steps:
        assert step.loss == pytest.approx(step.pg_loss + 0.5 * step.kl_loss - 0.25 * step.entropy, rel=1e-5)
        assert step.ppo_kl is not None and step.clip_fraction_lower is not None
    assert steps[0].ppo_kl == pytest.approx(0.0, abs=1e-6) and steps[0].clip_fraction_lower == 0.0
    plain = train_iteration(rows, policy_dir, tmp_path / "b", TrainConfig(mini_batch_size=4, micro_batch_size=2),
                            iteration=0, progress=False).steps
    assert plain[0].kl_loss is None and plain[0].loss == pytest.approx(plain[0].pg_loss, rel=1e-6)


def test_gradient_accumulation_equals_one_big_batch(policy_dir, tmp_path):
    rows = train_batch(load_policy(policy_dir))
    results = [
        train_iteration(
            rows,
            policy_dir,
            tmp_path / f"out{micro}",
            TrainConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=micro),
            iteration=0,
            progress=False,
        )
        for micro in (1, 4)
    ]
    one, four = (r.steps[0] for r in results)
    assert one.loss == pytest.approx(four.loss, abs=1e-6)
    assert one.grad_norm == pytest.approx(four.grad_norm, rel=1e-4)
    assert one.entropy == pytest.approx(four.entropy, rel=1e-5)
    for p, q in zip(results[0].model.parameters(), results[1].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_zero_advantages_leave_the_policy_unchanged(policy_dir, tmp_path):
    model = load_policy(policy_dir)
    rows = [dataclasses.replace(row, advantage=0.0) for row in train_batch(model)]
    config = TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=4)
    result = train_iteration(
        rows, policy_dir, tmp_path / "out", config, iteration=0, model=model, progress=False
    )
    assert result.steps[0].grad_norm == 0.0
    for p, q in zip(result.model.parameters(), load_policy(policy_dir).parameters(), strict=True):
        assert torch.equal(p, q)


def test_rejected_rows_keep_verls_optimiser_steps(policy_dir, tmp_path):
    """Sequence-level rejection empties three of four rows: they stay in the batch with a zero mask
    (verl's), so the iteration still takes its two optimiser steps over mini batches of two, each
    step's token count the kept tokens of its rows; a step of rejected rows only has a zero
    gradient."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    shifted = [dataclasses.replace(row, behavior_logprobs=tuple(lp - 0.5 * m for lp, m in zip(
        row.old_logprobs, row.loss_mask, strict=True))) if index else row for index, row in enumerate(rows)]
    config = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2, rollout_rs="sequence",
                         rollout_rs_threshold=1.5)  # ratios e^(0.5 n) > 1.5 for n >= 1 loss tokens
    result = train_iteration(shifted, policy_dir, tmp_path / "out", config, 0, model=model, progress=False)
    assert [s.optimizer_step for s in result.steps] == [0, 1]
    assert sorted(s.tokens for s in result.steps) == [0, sum(rows[0].loss_mask[1:])]
    empty = next(s for s in result.steps if s.tokens == 0)
    assert (empty.loss, empty.grad_norm) == (0.0, 0.0)
    assert json.loads(result.steps[0].rollout_corr)["rollout_rs_seq_masked_fraction"] == 0.75


# ---------------------------------------------------------------------------
# Row selection and batching (no model)


def test_an_iteration_whose_every_step_is_skipped_fails_and_saves_nothing(policy_dir, tmp_path, monkeypatch, recwarn):
    """In float32 (no loss scale whose search may skip steps) a gradient norm that is never finite
    skips both steps of the iteration: it trained nothing, so it fails in one line, no checkpoint.
    The schedule moving on before any optimiser step ran is not torch's warning too: the skip is
    said once."""
    from cleaner.errors import JobError

    rows = train_batch(load_policy(policy_dir))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda parameters, max_norm: torch.tensor(math.inf))
    with pytest.raises(JobError, match=r"^iteration 3: every one of its 2 steps was skipped \(gradient norm inf\)"):
        train_iteration(rows, policy_dir, tmp_path / "out", TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2),
                        iteration=3, progress=False)
    assert not (tmp_path / "out").exists()
    assert [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message)] == []


def test_prepare_rows_keeps_empty_masks_as_verl_and_applies_dynamic_sampling():
    """A row without loss tokens stays in the batch (verl keeps it with its zero mask): the mini
    batches are verl's."""
    rows = [
        train_row("a0", "a", [1, 2, 3], 1, 1.0, 0.0),
        train_row("a1", "a", [1, 2, 3], 1, 1.0, 0.0),
        train_row("b0", "b", [1, 2, 3], 1, 1.0, 1.0),
        train_row("b1", "b", [1, 2, 3], 1, 0.0, -1.0),
        train_row("empty", "b", [1, 2, 3], 1, 0.0, -1.0, loss_mask=[0, 0, 0]),
        train_row(
            "first-only", "b", [1, 2, 3], 0, 0.0, -1.0, loss_mask=[1, 0, 0]
        ),  # position 0 never trains
    ]
    assert [r.rollout_id for r in prepare_rows(rows, TrainConfig())] == ["a0", "a1", "b0", "b1", "empty",
                                                                          "first-only"]
    kept = prepare_rows(rows, TrainConfig(dynamic_sampling=True))
    assert [r.rollout_id for r in kept] == ["b0", "b1", "empty", "first-only"]


def test_prepare_rows_skips_infra_faults_before_dynamic_sampling_and_shaping():
    rows = [train_row("b0", "b", [1, 2, 3], 1, 1.0, 1.0), train_row("b1", "b", [1, 2, 3], 1, 0.0, -1.0),
            dataclasses.replace(train_row("b2", "b", [1, 2, 3], 1, 0.0, 0.0), infra_fault=True),
            train_row("c0", "c", [1, 2, 3], 1, 1.0, 0.0),
            dataclasses.replace(train_row("c1", "c", [1, 2, 3], 1, 0.0, 0.0), infra_fault=True)]
    assert [r.rollout_id for r in prepare_rows(rows, TrainConfig())] == ["b0", "b1", "c0"]
    # Group c keeps one row once the fault is out: equal rewards, dropped by dynamic sampling.
    assert [r.rollout_id for r in prepare_rows(rows, TrainConfig(dynamic_sampling=True))] == ["b0", "b1"]


def test_overlong_shaping_recomputes_group_advantages():
    # max 10, buffer 4: response lengths 5 (no penalty) and 8 (penalty -0.5), both correct.
    rows = [train_row("short", "g", [1] * 7, 2, 1.0, 0.0), train_row("long", "g", [1] * 10, 2, 1.0, 0.0)]
    shaped = prepare_rows(rows, TrainConfig(overlong_buffer=4, max_response_tokens=10))
    assert [r.reward for r in shaped] == pytest.approx([1.0, 0.5])
    std = math.sqrt(0.125)  # unbiased std of [1.0, 0.5]
    assert [r.advantage for r in shaped] == pytest.approx([0.25 / std, -0.25 / std], abs=1e-4)


@pytest.mark.parametrize("estimator", [{"norm_adv_by_std": False}, {"adv_estimator": "rloo"},
                                       {"adv_estimator": "reinforce_plus_plus_baseline"}])
def test_overlong_shaping_recomputes_advantages_with_the_purify_configs_estimator(estimator):
    """The shaped rewards 1.0, 0.5 (as above) and 0, 1 in a second group, through the estimator that
    computed the rows' advantages; per-token pushes move with the advantage."""
    purify = PurifyConfig(**estimator)
    rows = [train_row("short", "g", [1] * 7, 2, 1.0, 0.0), train_row("long", "g", [1] * 10, 2, 1.0, 0.0),
            train_row("h0", "h", [1] * 5, 2, 0.0, 0.0), train_row("h1", "h", [1] * 5, 2, 1.0, 0.0)]
    rows[0] = dataclasses.replace(rows[0], token_advantages=(0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0))
    shaped = prepare_rows(rows, TrainConfig(overlong_buffer=4, max_response_tokens=10), purify)
    rewards = [1.0, 0.5, 0.0, 1.0]
    expected = advantages(purify, ["g", "g", "h", "h"], rewards, [5, 8, 3, 3])
    assert [r.reward for r in shaped] == pytest.approx(rewards)
    assert [r.advantage for r in shaped] == pytest.approx(expected, rel=1e-6)
    assert shaped[0].token_advantages[2] == pytest.approx(expected[0] + 0.3, rel=1e-6)


def test_dynamic_sampling_whitens_a_whole_batch_estimator_over_the_rows_it_keeps():
    """verl computes advantages after filtering groups, so reinforce_plus_plus_baseline's whitening
    sees only the kept groups: without the all-equal group's zeros the spread is otherwise."""
    purify = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")
    rows = [train_row("a0", "a", [1] * 6, 2, 1.0, 0.7), train_row("a1", "a", [1] * 4, 2, 0.0, -0.7),
            train_row("z0", "z", [1] * 8, 2, 1.0, 0.0), train_row("z1", "z", [1] * 8, 2, 1.0, 0.0)]
    kept = prepare_rows(rows, TrainConfig(dynamic_sampling=True), purify)
    assert [r.rollout_id for r in kept] == ["a0", "a1"]
    assert [r.advantage for r in kept] == pytest.approx(advantages(purify, ["a", "a"], [1.0, 0.0], [4, 2]), rel=1e-6)
    grpo = prepare_rows(rows, TrainConfig(dynamic_sampling=True), PurifyConfig())  # a group's own: as stored
    assert [r.advantage for r in grpo] == [0.7, -0.7]


def test_mini_batches_are_a_seeded_shuffle():
    rows = [train_row(f"r{i}", "g", [1, 2], 1, 0.0, 0.0) for i in range(10)]
    config = TrainConfig(mini_batch_size=4, micro_batch_size=2, epochs=2)

    def order(cfg, iteration=0):
        return [[r.rollout_id for r in mini] for mini in iter_mini_batches(rows, cfg, iteration)]

    first = order(config)
    assert [len(m) for m in first] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(first[:3], [])) == sorted(r.rollout_id for r in rows)  # each epoch covers all
    assert order(config) == first
    assert order(dataclasses.replace(config, seed=1)) != first
    assert order(config, iteration=1) != first


def test_mini_batches_depend_on_the_rows_not_their_input_order():
    """Arms of an experiment (and a resumed run reading rows back) hand the trainer the same rows
    in other orders; a negative sample sorts right after its rollout's own row."""
    rows = [train_row(f"r{i}", "g", [1, 2], 1, 0.0, 0.0) for i in range(7)]
    rows.append(dataclasses.replace(rows[3], negative_seq=5))
    config = TrainConfig(mini_batch_size=3, micro_batch_size=1)

    def order(given):
        return [[(r.rollout_id, r.negative_seq) for r in mini] for mini in iter_mini_batches(given, config, 0)]

    assert order(rows[::-1]) == order(rows) == order(rows[4:] + rows[:4])
    assert len(set(sum(order(rows), []))) == len(rows)  # every row once, the negative sample too


def test_collate_right_pads_and_masks_position_zero():
    rows = [
        train_row("a", "g", [5, 6, 7], 0, 0.0, 2.0, loss_mask=[1, 1, 0]),
        train_row("b", "g", [8], 0, 0.0, -1.0),
    ]
    batch = collate_rows(rows, "cpu")
    assert batch.token_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert batch.advantages.tolist() == [[2.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]  # per token; 0 on padding
