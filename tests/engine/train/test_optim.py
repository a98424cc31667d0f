"""One optimiser for the run: persistence across iterations, checkpointing, warmup (train/optim.py)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle

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



# ---------------------------------------------------------------------------
# What a checkpoint's state holds and how a bad one is refused (found by `make mutants`)


def test_the_state_holds_master_weights_only_when_asked_and_as_copies():
    model = torch.nn.Linear(2, 1)
    optimization = new_optimization(model, CONFIG)
    assert set(optimization.state()) == {"format", "optimizer", "optimizer_step"}
    master = optimization.state(master_weights=True)["master_weights"]
    assert master["weight"].device.type == "cpu" and torch.equal(master["weight"], model.weight)
    assert master["weight"].data_ptr() != model.weight.data_ptr()  # a copy: training on leaves it as saved


@pytest.mark.gpu
def test_master_weights_of_a_gpu_model_are_saved_from_the_host():
    model = torch.nn.Linear(2, 1).cuda()
    master = new_optimization(model, CONFIG).state(master_weights=True)["master_weights"]
    assert master["weight"].device.type == "cpu"


def _checkpoint(policy_dir, tmp_path, state) -> object:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((policy_dir / name).read_bytes())
    (tmp_path / STATE_PATH).parent.mkdir(exist_ok=True)
    torch.save(state, tmp_path / STATE_PATH)
    return load_policy(tmp_path)


def test_resuming_and_starting_fresh_say_which_checkpoint_and_step(policy_dir, tmp_path, caplog):
    model = load_policy(policy_dir)
    state = new_optimization(model, CONFIG, step=7).state()
    model = _checkpoint(policy_dir, tmp_path, state)
    with caplog.at_level(logging.INFO, logger="cleaner.engine.train.optim"):
        load_optimization(model, CONFIG, tmp_path)
        load_optimization(model, CONFIG, policy_dir)
    assert [r.getMessage() for r in caplog.records] == [
        f"resuming the optimiser of {tmp_path} at step 7",
        f"{policy_dir} holds no optimiser state ({STATE_PATH}): the optimiser starts fresh at step 0"]


def test_an_unusable_state_is_refused_naming_the_file_and_what_was_expected(policy_dir, tmp_path):
    model = load_policy(policy_dir)
    state = new_optimization(model, CONFIG).state()
    path = tmp_path / STATE_PATH
    model = _checkpoint(policy_dir, tmp_path, {**state, "format": 99})
    with pytest.raises(OptimizerStateError) as refused:
        load_optimization(model, CONFIG, tmp_path)
    assert str(refused.value) == f"{path}: optimiser state format 99, expected 1"
    other = new_optimization(torch.nn.Linear(2, 1), CONFIG).state()
    _checkpoint(policy_dir, tmp_path, other)
    with pytest.raises(OptimizerStateError) as refused:
        load_optimization(model, CONFIG, tmp_path)
    trained = len([p for p in model.parameters() if p.requires_grad])
    assert str(refused.value) == (f"{path}: optimiser state for 2 parameters, the model trains {trained}; it belongs "
                                  "to another architecture")
    _checkpoint(policy_dir, tmp_path, {**state, "master_weights": {"other.weight": torch.zeros(1)}})
    with pytest.raises(OptimizerStateError) as refused:
        load_optimization(model, CONFIG, tmp_path)
    assert str(refused.value) == (f"{path}: master weights for other parameters than the model trains; it belongs "
                                  "to another architecture")


def test_a_state_file_holding_more_than_tensors_is_not_unpickled(policy_dir, tmp_path):
    model = _checkpoint(policy_dir, tmp_path, {"format": 1, "payload": datetime.timedelta(1)})
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_optimization(model, CONFIG, tmp_path)


def test_the_other_engines_state_is_named_with_its_checkpoint(policy_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((policy_dir / name).read_bytes())
    (tmp_path / DEEPSPEED_STATE_META).parent.mkdir()
    (tmp_path / DEEPSPEED_STATE_META).write_text('{"format": 1, "optimizer_step": 3}')
    with pytest.raises(OptimizerStateError) as refused:
        load_optimization(load_policy(tmp_path), CONFIG, tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}: its optimiser state ({DEEPSPEED_STATE_META}) was written by the deepspeed engine; continue "
        "with --engine deepspeed, or delete its optimizer/ directory to start a fresh optimiser")


def test_adamw_is_fused_only_on_a_gpu_whatever_the_saved_state_says():
    """A state saved on a GPU (fused, foreach) resumes on the CPU unfused: the implementation is
    where it runs now."""
    model = torch.nn.Linear(2, 1)
    saved = new_optimization(model, CONFIG).state()["optimizer"]
    for group in saved["param_groups"]:
        group.update(fused=True, foreach=True)
    optimization = new_optimization(model, CONFIG, optimizer_state=saved)
    assert optimization.optimizer.defaults["fused"] is None
    assert [(g["fused"], g["foreach"]) for g in optimization.optimizer.param_groups] == [(None, None)]


@pytest.mark.gpu
def test_adamw_is_fused_and_the_scaler_on_the_gpu_there():
    model = torch.nn.Linear(2, 1).cuda()
    optimization = new_optimization(model, dataclasses.replace(CONFIG, compute_dtype="float16"))
    assert optimization.optimizer.defaults["fused"] is True
    assert optimization.optimizer.param_groups[0]["fused"] is True
    assert optimization.scaler is not None and optimization.scaler._device == "cuda"


def test_a_resumed_scaler_takes_verls_growth_interval_over_the_saved_one():
    config = dataclasses.replace(CONFIG, compute_dtype="float16")
    model = torch.nn.Linear(2, 1)
    older = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2000).state_dict()
    scaler = new_optimization(model, config, scaler_state=older).scaler
    assert (scaler.get_scale(), scaler.state_dict()["growth_interval"]) == (1024.0, 400)
