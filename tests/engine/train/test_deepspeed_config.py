"""The DeepSpeed engine's rules that need no DeepSpeed: its config (deepspeed_config.py), how the
ranks share and scale a mini batch, and which saved optimiser state it resumes (deepspeed_engine.py).
The engine itself runs in tests/engine/train/test_deepspeed.py (slow, two CPU processes)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.deepspeed_config import (
    DeepSpeedConfigError,
    deepspeed_config_for,
    read_deepspeed_config,
)
from cleaner.engine.train.deepspeed_engine import (
    STATE_FORMAT,
    rank_loss_scale,
    rank_micro_batches,
    saved_optimizer_step,
)
from cleaner.engine.train.optim import (
    DEEPSPEED_STATE_META,
    STATE_PATH,
    OptimizerStateError,
)
from cleaner.engine.train.packing import micro_batches, pack_rows
from cleaner.engine.train.policy import TrainablePolicy
from cleaner.engine.train.rollout_correction import Corrected
from cleaner.engine.train.step import batch_totals, forward_micro_batch
from tests.factories import train_batch, train_row


def _config(tmp_path, ds_config: dict, **train) -> TrainConfig:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    return TrainConfig(engine="deepspeed", deepspeed_config=str(path), **train)


# ---------------------------------------------------------------------------
# The config file


def test_cleaner_sets_batch_sizes_and_clipping_and_keeps_deepspeeds_own_settings(tmp_path):
    config = _config(tmp_path, {"zero_optimization": {"stage": 2}, "bf16": {"immediate_grad_update": True}},
                     mini_batch_size=64, micro_batch_size=8, max_grad_norm=0.5, compute_dtype="bfloat16")
    ds_config = deepspeed_config_for(config, world_size=2)
    assert ds_config == {
        "zero_optimization": {"stage": 2}, "bf16": {"immediate_grad_update": True, "enabled": True},
        "fp16": {"enabled": False}, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,  # 64 / (8 x 2)
        "train_batch_size": 64, "gradient_clipping": 0.5,
    }
    # 6 rows on 4 ranks of 1: ceil(6 / 4) = 2 micro batches each, 8 slots (padded with weight 0)
    config = _config(tmp_path, {}, mini_batch_size=6, micro_batch_size=1)
    ds_config = deepspeed_config_for(config, world_size=4)
    assert (ds_config["gradient_accumulation_steps"], ds_config["train_batch_size"]) == (2, 8)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps", "gradient_clipping", "optimizer",
                                 "scheduler"])
def test_a_file_setting_what_cleaner_sets_is_an_error_naming_the_key(tmp_path, key):
    config = _config(tmp_path, {"zero_optimization": {"stage": 2}, key: 3})
    with pytest.raises(DeepSpeedConfigError, match=f"ds.json: '{key}' is cleaner's to set"):
        deepspeed_config_for(config, world_size=2)


def test_precision_follows_compute_dtype_and_a_file_setting_it_is_an_error(tmp_path):
    # --compute-dtype auto: bfloat16 on GPU ranks, float32 on CPU ranks (gloo)
    assert deepspeed_config_for(_config(tmp_path, {}), world_size=1)["bf16"] == {"enabled": True}
    assert deepspeed_config_for(_config(tmp_path, {}), world_size=1, device_type="cpu")["bf16"] == {"enabled": False}
    assert deepspeed_config_for(_config(tmp_path, {}, compute_dtype="float32"), world_size=1)["bf16"] == {"enabled": False}
    auto = _config(tmp_path, {"bf16": {"enabled": "auto"}}, compute_dtype="bfloat16")
    assert deepspeed_config_for(auto, world_size=1)["bf16"] == {"enabled": True}
    with pytest.raises(DeepSpeedConfigError, match="bf16.enabled is cleaner's to set, from --compute-dtype"):
        deepspeed_config_for(_config(tmp_path, {"bf16": {"enabled": True}}), world_size=1)
    with pytest.raises(DeepSpeedConfigError, match="fp16.enabled is cleaner's to set, from --compute-dtype "
                                                   r"\(float16 enables it\)"):
        deepspeed_config_for(_config(tmp_path, {"fp16": {"enabled": True}}), world_size=1)
    # --compute-dtype float16 (the reference's): fp16 with dynamic loss scaling, the file's other settings kept
    fp16 = deepspeed_config_for(_config(tmp_path, {"fp16": {"initial_scale_power": 12}}, compute_dtype="float16"),
                                world_size=1)
    assert (fp16["fp16"], fp16["bf16"]) == ({"initial_scale_power": 12, "enabled": True, "loss_scale": 0},
                                            {"enabled": False})


def test_a_static_loss_scale_in_the_file_is_kept_and_said_in_one_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="cleaner.engine.train.deepspeed_config"):
        dynamic = deepspeed_config_for(_config(tmp_path, {}, compute_dtype="float16"), world_size=1)
    assert dynamic["fp16"]["loss_scale"] == 0 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="cleaner.engine.train.deepspeed_config"):
        static = deepspeed_config_for(_config(tmp_path, {"fp16": {"loss_scale": 128}}, compute_dtype="float16"),
                                      world_size=1)
    assert static["fp16"]["loss_scale"] == 128
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'ds.json'}: fp16.loss_scale 128 is a static loss scale: the run keeps it, not the dynamic "
        "scaling the torch engine uses (remove it, or set 0, for dynamic)"]


class _OverflowingEngine:
    """DeepSpeed's engine as 0.19's fp16 optimiser leaves it after an overflow: the step not applied,
    `get_global_grad_norm()` still the previous step's norm (runtime/fp16/fused_optimizer.py returns
    before updating it). Forward and backward are the policy's."""

    def __init__(self, policy):
        self.policy, self.device, self.module = policy, "cpu", type("Module", (), {"policy": policy.policy})

    def __call__(self, batch):
        return self.policy(batch)

    def set_gradient_accumulation_boundary(self, boundary):
        pass

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        pass

    def was_step_applied(self):
        return False

    def get_global_grad_norm(self):
        return 0.37  # the last applied step's


def test_a_step_deepspeed_skips_for_overflow_logs_a_non_finite_grad_norm(policy_dir, monkeypatch, recwarn):
    from cleaner.engine.train import deepspeed_engine
    from cleaner.engine.train.optim import new_optimization

    class World:  # one rank, nothing to reduce
        get_world_size, get_rank = staticmethod(lambda: 1), staticmethod(lambda: 0)
        all_reduce = staticmethod(lambda tensor: None)

    monkeypatch.setattr(deepspeed_engine, "_comm", lambda: World)
    model = load_policy(policy_dir)
    config = TrainConfig(mini_batch_size=2, micro_batch_size=1)
    optimization = new_optimization(model, config, step=5)
    row = deepspeed_engine._deepspeed_step(_OverflowingEngine(TrainablePolicy(model, config)), optimization, None,
                                           train_batch(model)[:2], Corrected([], {}), config, 0, 0)
    assert row.grad_norm == float("inf")  # as the torch engine logs a skipped step
    assert row.optimizer_step == 5 and optimization.step == 6  # the schedule moved on
    assert [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message)] == []  # said once, as skipped


def test_auto_values_are_cleaners_to_fill(tmp_path):
    config = _config(tmp_path, {"train_batch_size": "auto", "gradient_clipping": "auto"},
                     mini_batch_size=4, micro_batch_size=2, max_grad_norm=2.0)
    ds_config = deepspeed_config_for(config, world_size=1)
    assert (ds_config["train_batch_size"], ds_config["gradient_clipping"]) == (4, 2.0)


def test_zero3_gathers_the_weights_on_save_and_refuses_a_file_that_turns_it_off(tmp_path):
    config = _config(tmp_path, {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}})
    zero = deepspeed_config_for(config, world_size=2)["zero_optimization"]
    assert zero == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}  # one spelling
    config = _config(tmp_path, {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}})
    with pytest.raises(DeepSpeedConfigError, match="gather_16bit_weights_on_model_save is false"):
        deepspeed_config_for(config, world_size=2)
    # ZeRO-2 keeps whole weights on every rank: nothing to gather, nothing set
    config = _config(tmp_path, {"zero_optimization": {"stage": 2}})
    assert deepspeed_config_for(config, world_size=2)["zero_optimization"] == {"stage": 2}


def test_an_offloaded_optimizer_is_still_cleaners_adamw(tmp_path):
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_config_for(_config(tmp_path, offload), world_size=1)["zero_force_ds_cpu_optimizer"] is False
    with pytest.raises(DeepSpeedConfigError, match="zero_force_ds_cpu_optimizer is true"):
        deepspeed_config_for(_config(tmp_path, {**offload, "zero_force_ds_cpu_optimizer": True}), world_size=1)


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1]", "a JSON object, got list"),
                                           ('{"zero_optimization": 2}', "must be a JSON object")])
def test_a_malformed_file_is_an_error_naming_it(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError, match=message) as error:
        read_deepspeed_config(path)
    assert str(path) in str(error.value)


def test_the_cli_prints_one_error_line_before_training(tmp_path, policy_dir):
    path = tmp_path / "ds.json"
    path.write_text('{"optimizer": {"type": "AdamW"}}')
    result = CliRunner().invoke(app, ["train", "--warehouse", str(tmp_path / "wh"), "--config-id", "c",
                                      "--policy", str(policy_dir), "--out", str(tmp_path / "out"),
                                      "--engine", "deepspeed", "--deepspeed-config", str(path)])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "'optimizer' is cleaner's to set" in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# Ranks: shares, padding and the gradient scale


def test_ranks_reach_the_accumulation_boundary_together():
    rows = [train_row(f"r{i}", "g", [1, 2], 1, 0.0, 0.0) for i in range(5)]

    def plan(rank, world_size=2, **train):
        config = TrainConfig(mini_batch_size=5, micro_batch_size=2, **train)
        return [([r.rollout_id for r in micro], weight)
                for micro, weight in rank_micro_batches(rows, rank, world_size, config)]

    assert plan(0) == [(["r0", "r2"], 1.0), (["r4"], 1.0)]
    assert plan(1) == [(["r1", "r3"], 1.0), (["r1"], 0.0)]  # padded with a zero-weight repeat
    assert plan(5, world_size=6) == [(["r0"], 0.0)]  # a rank with no share: the shortest row, weight 0


def test_token_budget_shares_balance_tokens_and_pad_to_the_longest_rank():
    # Lengths 9, 7, 5, 3, 2 on 2 ranks, longest first to the lighter rank: rank 0 takes 9, 3, 2
    # (14 tokens), rank 1 takes 7, 5 (12). A budget of 10 tokens: rank 0 packs [9], [3, 2]; rank 1
    # packs [7], [5]: two micro batches each, no padding.
    rows = [train_row(f"r{n}", "g", list(range(1, n + 1)), 1, 0.0, 0.0) for n in (5, 9, 2, 7, 3)]
    config = TrainConfig(mini_batch_size=5, micro_batch_size=1, max_tokens_per_micro_batch=10)

    def plan(rank, world_size=2):
        return [([r.rollout_id for r in micro], weight)
                for micro, weight in rank_micro_batches(rows, rank, world_size, config)]

    assert plan(0) == [(["r9"], 1.0), (["r3", "r2"], 1.0)]
    assert plan(1) == [(["r7"], 1.0), (["r5"], 1.0)]
    # on 4 ranks: 9 | 7 | 5 | 3 + 2; every rank runs one micro batch
    assert [plan(rank, 4) for rank in range(4)] == [[(["r9"], 1.0)], [(["r7"], 1.0)], [(["r5"], 1.0)],
                                                    [(["r3", "r2"], 1.0)]]


def _gradients(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size, budget", [(2, None), (3, None), (3, 12)])
def test_rank_shares_averaged_as_deepspeed_does_give_the_mini_batch_token_mean_gradient(policy_dir, world_size,
                                                                                        budget):
    """Each rank scales its share by world_size / (the mini batch's tokens); DeepSpeed's mean over
    ranks then equals the torch engine's gradient. With 3 ranks two of them pad with weight 0; with
    a token budget the shares are balanced by tokens instead."""
    model = load_policy(policy_dir)
    rows = train_batch(model)  # 5 + 8 + 4 + 7 = 24 loss tokens
    config = TrainConfig(mini_batch_size=4, micro_batch_size=1, max_tokens_per_micro_batch=budget)
    policy = TrainablePolicy(model, config)
    total = batch_totals(rows, config)
    model.zero_grad()
    for micro in micro_batches(rows, 1, None):
        forward_micro_batch(policy, None, micro, pack_rows(micro), config, total).loss.backward()
    expected = _gradients(model)

    averaged, loss = [torch.zeros_like(g) for g in expected], 0.0
    for rank in range(world_size):
        model.zero_grad()
        for micro, weight in rank_micro_batches(rows, rank, world_size, config):
            part = forward_micro_batch(policy, None, micro, pack_rows(micro), config, total)
            (part.loss * rank_loss_scale(weight, world_size)).backward()
            loss += weight * part.loss.item()
        averaged = [a + g / world_size for a, g in zip(averaged, _gradients(model), strict=True)]
    for got, want in zip(averaged, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
    assert loss == pytest.approx(6 / 24, abs=1e-6)  # ratios 1: -(5 - 8 + 4 - 7) / 24, as one process


# ---------------------------------------------------------------------------
# Which optimiser state a checkpoint resumes


def _meta(path, **values) -> None:
    (path / "optimizer").mkdir(parents=True, exist_ok=True)
    meta = {"format": STATE_FORMAT, "optimizer_step": 7, "zero_stage": 3, "world_size": 2, **values}
    (path / DEEPSPEED_STATE_META).write_text(json.dumps(meta))


def test_a_deepspeed_checkpoint_resumes_at_its_step_with_the_same_stage_and_ranks(tmp_path):
    _meta(tmp_path)
    assert saved_optimizer_step(tmp_path, {"zero_optimization": {"stage": 3}}, world_size=2) == 7
    with pytest.raises(OptimizerStateError, match="ZeRO stage 3 on 2 ranks, this run has stage 2 on 2"):
        saved_optimizer_step(tmp_path, {"zero_optimization": {"stage": 2}}, world_size=2)
    with pytest.raises(OptimizerStateError, match="this run has stage 3 on 4"):
        saved_optimizer_step(tmp_path, {"zero_optimization": {"stage": 3}}, world_size=4)


def test_a_plain_model_starts_fresh_and_a_torch_engine_checkpoint_is_refused(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert saved_optimizer_step(tmp_path, {}, world_size=2) is None
    assert "starts fresh at step 0" in caplog.text
    (tmp_path / STATE_PATH).parent.mkdir()
    (tmp_path / STATE_PATH).write_bytes(b"")
    with pytest.raises(OptimizerStateError, match="written by the torch engine; continue with --engine torch"):
        saved_optimizer_step(tmp_path, {}, world_size=2)
