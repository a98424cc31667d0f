"""One optimiser for the run: persistence across iterations, checkpointing, warmup (train/optim.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.optim import (
    DEEPSPEED_STATE_META,
    STATE_PATH,
    OptimizerStateError,
    load_optimization,
    new_optimization,
)
from cleaner.engine.train.trainer import train_iteration
from tests.factories import train_batch

CONFIG = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2)  # 2 steps per iteration


def _two_iterations(policy_dir, out_dir, persistent: bool):
    """Train iteration 0 and 1 on the same rows; the optimiser lives on, or is made anew."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    first = train_iteration(rows, policy_dir, out_dir / "it1", CONFIG, 0, model=model, progress=False)
    optimization = first.optimization if persistent else new_optimization(model, CONFIG)
    second = train_iteration(rows, out_dir / "it1", out_dir / "it2", CONFIG, 1, model=model,
                             progress=False, optimization=optimization)
    return first, second


def test_a_persistent_optimizer_trains_differently_from_a_fresh_one_per_iteration(policy_dir, tmp_path):
    _, kept = _two_iterations(policy_dir, tmp_path / "kept", persistent=True)
    _, fresh = _two_iterations(policy_dir, tmp_path / "fresh", persistent=False)
    assert [s.optimizer_step for s in kept.steps] == [2, 3]
    assert [s.optimizer_step for s in fresh.steps] == [0, 1]
    differences = [(p - q).abs().max().item()
                   for p, q in zip(kept.model.parameters(), fresh.model.parameters(), strict=True)]
    assert max(differences) > 1e-4
    # Both start iteration 1 from the same weights; only the optimisers' steps differ.
    assert kept.steps[0].loss == fresh.steps[0].loss and kept.steps[1].loss != fresh.steps[1].loss


def test_the_checkpoint_resumes_the_run_exactly(policy_dir, tmp_path):
    first, in_memory = _two_iterations(policy_dir, tmp_path / "a", persistent=True)
    # A new process: iteration 1 starts from the saved checkpoint and its saved optimiser.
    model = load_policy(first.out_path)
    resumed = train_iteration(train_batch(load_policy(policy_dir)), first.out_path, tmp_path / "b", CONFIG, 1,
                              model=model, progress=False)
    assert [s.optimizer_step for s in resumed.steps] == [2, 3]
    assert [s.loss for s in resumed.steps] == [s.loss for s in in_memory.steps]
    for p, q in zip(resumed.model.parameters(), in_memory.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_optimizer_state_survives_save_and_load_bit_for_bit(policy_dir, tmp_path):
    model = load_policy(policy_dir)
    result = train_iteration(train_batch(model), policy_dir, tmp_path / "it1", CONFIG, 0, model=model,
                             progress=False)
    assert (result.out_path / STATE_PATH).is_file()
    in_memory = result.optimization.state()
    loaded = load_optimization(load_policy(result.out_path), CONFIG, result.out_path).state()
    assert loaded["optimizer_step"] == in_memory["optimizer_step"] == 2
    state, expected = loaded["optimizer"]["state"], in_memory["optimizer"]["state"]
    assert state.keys() == expected.keys() and len(state) == len(list(model.parameters()))
    for index, entry in expected.items():
        assert entry.keys() == state[index].keys()
        for name, value in entry.items():
            assert torch.equal(state[index][name], value), (index, name)


def test_a_checkpoint_without_optimizer_state_starts_fresh_and_says_so(policy_dir, caplog):
    with caplog.at_level(logging.INFO, logger="cleaner.engine.train.optim"):
        optimization = load_optimization(load_policy(policy_dir), CONFIG, policy_dir)
    assert optimization.step == 0 and not optimization.optimizer.state
    assert "starts fresh" in caplog.text


def test_warmup_learning_rates_equal_hand_computed_values(policy_dir, tmp_path):
    # lr 0.01, warmup 3: steps 0, 1, 2 use 0, 0.01/3, 0.02/3; then 0.01. Two iterations of 2 steps.
    config = TrainConfig(lr=1e-2, warmup_steps=3, mini_batch_size=2, micro_batch_size=2)
    model = load_policy(policy_dir)
    rows = train_batch(model)
    first = train_iteration(rows, policy_dir, tmp_path / "1", config, 0, model=model, progress=False)
    second = train_iteration(rows, tmp_path / "1", tmp_path / "2", config, 1, model=model,
                             progress=False, optimization=first.optimization)
    steps = first.steps + second.steps
    assert [(s.iteration, s.step, s.optimizer_step) for s in steps] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert [s.lr for s in steps] == pytest.approx([0.0, 0.01 / 3, 0.02 / 3, 0.01], abs=1e-12)


def test_hyperparameters_come_from_the_config_and_the_position_from_the_checkpoint(policy_dir, tmp_path):
    first, _ = _two_iterations(policy_dir, tmp_path, persistent=True)
    other = TrainConfig(lr=5e-3, warmup_steps=4, weight_decay=0.1, mini_batch_size=2, micro_batch_size=2)
    loaded = load_optimization(load_policy(first.out_path), other, first.out_path)
    assert loaded.step == 2 and loaded.lr == pytest.approx(5e-3 * 2 / 4)
    assert loaded.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_the_torch_engine_refuses_a_deepspeed_engines_optimizer_state(policy_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((policy_dir / name).read_bytes())
    (tmp_path / DEEPSPEED_STATE_META).parent.mkdir()
    (tmp_path / DEEPSPEED_STATE_META).write_text('{"format": 1, "optimizer_step": 3}')
    with pytest.raises(OptimizerStateError, match="written by the deepspeed engine; continue with --engine deepspeed"):
        load_optimization(load_policy(tmp_path), CONFIG, tmp_path)


def test_a_fresh_optimizer_can_start_mid_run():
    """The DeepSpeed engine positions a new AdamW at the saved step before loading its moments."""
    model = torch.nn.Linear(2, 1)
    optimization = new_optimization(model, TrainConfig(lr=1e-2, warmup_steps=4), step=3)
    assert optimization.step == 3 and optimization.lr == pytest.approx(1e-2 * 3 / 4)

