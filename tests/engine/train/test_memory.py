"""The memory estimate before training on a GPU (memory.py), its refusal and the out-of-memory line,
computed by hand on small shapes; the CUDA device is stood in for (this machine has none)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from cleaner.config import TrainConfig
from cleaner.engine.train import memory
from cleaner.engine.train.job import TrainRequest, _check_memory
from cleaner.errors import JobError
from tests.factories import train_row
from tests.helpers import tiny_qwen3

GIB = 2**30
SHAPE = memory.ModelShape(parameters=1_000_000, hidden=100, intermediate=300, layers=4, vocab=1000)


def test_static_memory_by_hand_and_as_zero_partitions_it():
    fp32 = memory.plan(SHAPE, micro_tokens=10, compute_dtype="float32", checkpointing=False, kl=False,
                       chunk_tokens=512)
    assert (fp32.weights, fp32.gradients, fp32.optimizer, fp32.autocast_copy) == (4e6, 4e6, 8e6, 0)
    bf16 = memory.plan(SHAPE, micro_tokens=10, compute_dtype="bfloat16", checkpointing=False, kl=True,
                       chunk_tokens=512)
    assert bf16.autocast_copy == 0 and bf16.reference == 3e6  # autocast caches no copy; the reference in bf16
    zero = {stage: memory.plan(SHAPE, micro_tokens=10, compute_dtype="bfloat16", checkpointing=False, kl=False,
                               chunk_tokens=512, engine="deepspeed", zero_stage=stage, world_size=8)
            for stage in (0, 1, 2, 3)}
    # DeepSpeed's bf16: 2 + 2 bytes of weights and gradients, 12 of fp32 master and moments
    assert [(z.weights, z.gradients, z.optimizer) for z in zero.values()] == [
        (2e6, 2e6, 12e6), (2e6, 2e6, 1.5e6), (2e6, 250e3, 1.5e6), (250e3, 250e3, 1.5e6)]


def test_activations_and_head_by_hand():
    plain = memory.plan(SHAPE, micro_tokens=1000, compute_dtype="float32", checkpointing=False, kl=False,
                        chunk_tokens=256)
    per_layer = 10 * 100 + 5 * 300  # values per token and layer
    assert plain.activations == 1000 * 4 * per_layer * 4
    assert plain.head == 2 * 256 * 1000 * 4 + 2 * 1000 * 100 * 4
    checkpointed = memory.plan(SHAPE, micro_tokens=1000, compute_dtype="float32", checkpointing=True, kl=False,
                               chunk_tokens=256)
    assert checkpointed.activations == 1000 * (4 * 100 + per_layer) * 4  # the inputs, and one layer again
    assert checkpointed.peak < plain.peak


def test_a_plan_that_does_not_fit_is_one_line_naming_the_knobs():
    big = memory.plan(SHAPE, micro_tokens=16384, compute_dtype="float32", checkpointing=False, kl=True,
                      chunk_tokens=512, device_bytes=GIB // 4)
    assert not big.fits
    line = memory.refusal(big, what="cuda:0 (H100)", checkpointing=False, compute_dtype="float32",
                          engine="torch", zero_stage=0, micro_tokens=16384)
    assert "\n" not in line and line.startswith("cuda:0 (H100): training needs about")
    for knob in ("--gradient-checkpointing", "--compute-dtype bfloat16", "--max-tokens-per-micro-batch",
                 "--engine deepspeed"):
        assert knob in line
    small = dataclasses.replace(big, activations=0, head=0, device_bytes=80 * GIB)
    assert small.fits and memory.refusal(small, what="x", checkpointing=True, compute_dtype="bfloat16",
                                         engine="torch", zero_stage=0, micro_tokens=100) is None


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reports one GPU of `fake_gpu.total` bytes."""
    gpu = SimpleNamespace(total=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=gpu.total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    return gpu


def test_the_train_job_refuses_before_training_when_the_gpu_is_too_small(fake_gpu, tmp_path):
    model = tiny_qwen3(seed=0)  # 64 x 32 embeddings, 2 layers: a few tens of thousands of parameters
    rows = [train_row(f"r{i}", "g", list(range(1, 60)), 4, 1.0, 0.5) for i in range(8)]
    request = TrainRequest(0, "c", tmp_path / "policy", tmp_path / "out", TrainConfig(device="cuda"))
    fake_gpu.total = 2 * 2**30
    _check_memory(request, model, rows)  # fits: a few MiB, and the 1 GiB allowance for CUDA itself
    fake_gpu.total = 2**30
    with pytest.raises(JobError, match=r"cuda \(Fake GPU\): training needs about .* try --gradient-checkpointing"):
        _check_memory(request, model, rows)
    on_cpu = dataclasses.replace(request, config=TrainConfig(device="cpu"))
    _check_memory(on_cpu, model, rows)  # the host's memory is not checked


def test_an_out_of_memory_error_while_training_is_one_line_with_what_to_try(monkeypatch, small_run, tmp_path):
    import shutil

    from typer.testing import CliRunner

    import cleaner.engine.train.job as job
    from cleaner.cli import app
    from cleaner.warehouse import Warehouse

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(job, "train_iteration", out_of_memory)
    shutil.copytree(small_run / "warehouse", tmp_path / "w")
    [(config_id,)] = Warehouse(tmp_path / "w").connect().sql(
        "SELECT DISTINCT config_id FROM purified WHERE iteration = 0").fetchall()
    result = CliRunner().invoke(app, ["train", "-w", str(tmp_path / "w"), "--iteration", "0", "--config-id",
                                      config_id, "--policy", str(small_run / "checkpoints" / "iteration-1"),
                                      "--out", str(tmp_path / "out")])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "error: out of GPU memory while training iteration 0" in output
    assert "Tried to allocate 20.00 GiB" in output and "--gradient-checkpointing" in output
