"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes against the torch engine (deepspeed_engine.py).

Each case runs `cleaner train --engine deepspeed` under torchrun (2 processes, gloo,
DS_ACCELERATOR=cpu) with an example config holding only the ZeRO stage, twice: iteration 0 from
the plain policy, iteration 1 from that checkpoint, so the second resumes the saved DeepSpeed
optimiser state. The torch engine trains the same rows in this process, its iteration 1 resuming
its own checkpoint. Six rows per iteration in mini batches of 4 and micro batches of 1: each rank
accumulates 2 micro batches, and the last mini batch (2 rows) pads each rank with a zero-weight one.
Warmup over 2 steps makes the schedule's position visible (lr 0, 1/2, 1, 1 x lr).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.optim import DEEPSPEED_STATE_DIR, DEEPSPEED_STATE_META, new_optimization
from cleaner.engine.train.trainer import train_iteration
from cleaner.records import PurifyConfigRow
from cleaner.warehouse import Warehouse
from tests.factories import VOCAB, make_rollout, make_segments, train_row, with_old_logprobs
from tests.helpers import tiny_qwen3

# deepspeed runs in the launched processes only; this one needs to know it is there
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="needs deepspeed: pip install 'cleaner[deepspeed]'")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "deepspeed"
CONFIG_ID = "cfgdeepspeed"
LR, WARMUP_STEPS, MINI, MICRO = 1e-4, 2, 4, 1
TOLERANCE = 1e-5


def _rows(model, iteration):
    generator = torch.Generator().manual_seed(10 + iteration)
    rows = []
    for i in range(6):
        length, prompt_len = 6 + 2 * i, 3
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append(train_row(f"r{i}", f"g{i // 2}", ids, prompt_len, float(i % 2), 1.0 - 2 * (i % 2)))
    return [dataclasses.replace(row, iteration=iteration) for row in with_old_logprobs(model, rows)]


@pytest.fixture(scope="module")
def policy_and_rows(tmp_path_factory):
    """A policy and the rows of iterations 0 and 1, scored by it."""
    policy = tmp_path_factory.mktemp("deepspeed") / "policy"
    tiny_qwen3(seed=0, vocab_size=VOCAB).save_pretrained(policy)
    model = load_policy(policy)
    return policy, {iteration: _rows(model, iteration) for iteration in (0, 1)}


def _warehouse(root: Path, rows) -> Warehouse:
    warehouse = Warehouse(root)
    config_row = PurifyConfigRow(CONFIG_ID, 0.5, 1.0, "code", "always", "{}")
    for iteration, iteration_rows in rows.items():
        ids = sorted({row.rollout_id for row in iteration_rows})  # the rollouts the rows are of (the readers' gate)
        warehouse.write_rollouts(iteration, [make_rollout(i, iteration) for i in ids],
                                 [s for i in ids for s in make_segments(i, iteration)])
        warehouse.write_purified(iteration, config_row, iteration_rows)
    return warehouse


def _torchrun_train(warehouse, iteration, policy, out, ds_config, extra=(), mini=MINI, micro=MICRO) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "cleaner.cli", "train", "--warehouse", str(warehouse.root), "--iteration",
               str(iteration), "--config-id", CONFIG_ID, "--policy", str(policy), "--out", str(out),
               "--lr", str(LR), "--warmup-steps", str(WARMUP_STEPS), "--mini-batch-size", str(mini),
               "--micro-batch-size", str(micro), "--engine", "deepspeed", "--deepspeed-config",
               str(ds_config), *extra]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-20000:]
    return done.stdout


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.state_dict().items(), b.state_dict().items(), strict=True)
    return max((p - q).abs().max().item() for (_, p), (_, q) in pairs)


# A token budget of 16 packs the rows (6 to 16 tokens) two or one to a micro batch and shares them
# between the ranks by tokens, not by position: a different accumulation, the same update.
REAL_SHAPE_FLAGS = ("--max-tokens-per-micro-batch", "16", "--gradient-checkpointing")


# verl's gspo, with the KL aggregated as its loss, sequence-level: each rank's share of the mini
# batch's rows, which the ranks split unevenly (3 rows on 2 ranks)
GSPO = {"loss_mode": "gspo", "kl_coef": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("stage, extra, mini, micro, objective", [
    (2, (), MINI, MICRO, {}),
    # ZeRO-3 with mini batches of 3 on 2 ranks packed by a token budget, with checkpointing: the
    # ranks hold unequal rows and tokens, yet ZeRO-3's per-layer gathers (again in checkpointing's
    # recomputation) must pair up across them
    (3, REAL_SHAPE_FLAGS, 3, 2, {}),
    (2, (), 3, MICRO, GSPO),
], ids=["zero2", "zero3-uneven-rows-token-budget-checkpointing", "zero2-gspo-kl-uneven-rows"])
def test_deepspeed_on_two_cpu_processes_equals_the_torch_engine(policy_and_rows, tmp_path, stage, extra, mini,
                                                                micro, objective):
    from transformers import AutoModelForCausalLM

    policy, rows = policy_and_rows
    warehouse = _warehouse(tmp_path / "wh", rows)
    ds_config = EXAMPLES / f"zero{stage}.json"
    config = TrainConfig(lr=LR, warmup_steps=WARMUP_STEPS, mini_batch_size=mini, micro_batch_size=1, **objective)
    extra = (*extra, *(word for name, value in objective.items() for word in ("--" + name.replace("_", "-"), str(value))))
    plain = [train_iteration(rows[0], policy, tmp_path / "torch-1", config, 0, progress=False)]
    plain.append(train_iteration(rows[1], plain[0].out_path, tmp_path / "torch-2", config, 1, progress=False))

    differences = []
    previous = policy
    for iteration in (0, 1):
        out = tmp_path / f"ds-{iteration + 1}"
        stdout = _torchrun_train(warehouse, iteration, previous, out, ds_config, extra, mini, micro)
        assert stdout.count("checkpoint -> ") == 1  # rank 0 reports, the other rank does not
        assert (out / DEEPSPEED_STATE_META).is_file() and (out / DEEPSPEED_STATE_DIR).is_dir()
        loaded = AutoModelForCausalLM.from_pretrained(out)
        differences.append(_max_difference(loaded, load_policy(plain[iteration].out_path)))
        previous = out
    print(f"ZeRO-{stage}: max |weight difference| to the torch engine per iteration: {differences}")
    assert max(differences) < TOLERANCE
    # The comparison sees the resumed moments: a fresh AdamW at the same schedule position lands
    # 3.3e-4 away from the resumed torch run.
    model = load_policy(plain[0].out_path)
    fresh = train_iteration(rows[1], plain[0].out_path, tmp_path / "fresh-2", config, 1, model=model,
                            optimization=new_optimization(model, config, step=2), progress=False)
    assert _max_difference(fresh.model, load_policy(plain[1].out_path)) > 10 * TOLERANCE

    if objective:  # every term the ranks reported adds up to the torch engine's
        terms = warehouse.connect().sql("SELECT pg_loss, kl_loss FROM train_steps ORDER BY iteration, step").fetchall()
        torch_terms = [(s.pg_loss, s.kl_loss) for result in plain for s in result.steps]
        assert [value for row in terms for value in row] == pytest.approx(
            [value for row in torch_terms for value in row], abs=1e-5)
    steps = warehouse.connect().sql(
        "SELECT iteration, step, optimizer_step, lr, loss, grad_norm FROM train_steps ORDER BY iteration, step"
    ).fetchall()
    assert [(i, s, o) for i, s, o, *_ in steps] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert [lr for *_, lr, _, _ in steps] == pytest.approx([0.0, LR / 2, LR, LR])
    torch_steps = [s for result in plain for s in result.steps]
    assert [loss for *_, loss, _ in steps] == pytest.approx([s.loss for s in torch_steps], abs=1e-5)
    # Adam's update ignores a constant factor on the gradient; its norm does not (ranks x scale)
    assert [norm for *_, norm in steps] == pytest.approx([s.grad_norm for s in torch_steps], rel=1e-5)


@pytest.mark.slow
def test_deepspeed_bfloat16_trains_what_the_torch_engine_trains_and_saves_bfloat16(policy_and_rows, tmp_path):
    """--compute-dtype bfloat16 turns on DeepSpeed's bf16 (bfloat16 weights, float32 master weights
    and moments); with --save-dtype bfloat16 the checkpoint is bfloat16 and resumes. At lr 1e-3 the
    update (2.5e-3 per weight) is a tenth of the weights: per weight matrix, the distance to the
    float32 torch engine's result must be a small share of the update (bfloat16's rounding of the
    weights is ~4% of it; an update not taken would be 100%). The norm weights, near 1, move less
    than one bfloat16 step there and are left out."""
    from transformers import AutoModelForCausalLM

    policy, rows = policy_and_rows
    warehouse = _warehouse(tmp_path / "wh", rows)
    lr, flags = 1e-3, ("--compute-dtype", "bfloat16", "--save-dtype", "bfloat16")
    config = TrainConfig(lr=lr, warmup_steps=WARMUP_STEPS, mini_batch_size=MINI, micro_batch_size=MICRO)
    plain = train_iteration(rows[0], policy, tmp_path / "torch-1", config, 0, progress=False)
    plain = train_iteration(rows[1], plain.out_path, tmp_path / "torch-2", config, 1, progress=False)
    previous = policy
    for iteration in (0, 1):
        out = tmp_path / f"ds-{iteration + 1}"
        _torchrun_train(warehouse, iteration, previous, out, EXAMPLES / "zero2.json", ("--lr", str(lr), *flags))
        previous = out
    trained = AutoModelForCausalLM.from_pretrained(previous)
    assert trained.dtype == torch.bfloat16  # config.json and the weights say bfloat16
    expected, initial = load_policy(plain.out_path), load_policy(policy)
    for (name, got), want, start in zip(trained.named_parameters(), expected.parameters(), initial.parameters(),
                                        strict=True):
        if start.dim() < 2:  # norm weights near 1 move less than one bfloat16 step
            continue
        update = (want - start).norm()
        off = (got.float() - want).norm() / update
        assert off < 0.1, f"{name}: |bf16 DeepSpeed - float32 torch| / |update| = {off:.3f}"


def _adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("stage, extra", [(2, ()), (3, REAL_SHAPE_FLAGS)],
                         ids=["zero2", "zero3-token-budget-checkpointing"])
def test_deepspeed_lora_on_two_cpu_processes_equals_the_torch_engine(policy_and_rows, tmp_path, stage, extra):
    """--lora-rank 4 with the KL term on (its reference the engine's own base, adapters disabled, in
    every micro batch on both ranks) over two iterations, the second resuming the adapters and
    DeepSpeed's partitioned state of them: the adapters, the merged weights and every step's loss
    and gradient norm equal the torch engine's in one process within 1e-5."""
    from transformers import AutoModelForCausalLM

    policy, rows = policy_and_rows
    warehouse = _warehouse(tmp_path / "wh", rows)
    lora = ("--lora-rank", "4", "--lora-alpha", "8", "--kl-coef", "0.5", "--lr", "1e-2")
    config = TrainConfig(lr=1e-2, warmup_steps=WARMUP_STEPS, mini_batch_size=MINI, micro_batch_size=1, lora_rank=4,
                         lora_alpha=8, kl_coef=0.5)
    plain = [train_iteration(rows[0], policy, tmp_path / "torch-1", config, 0, progress=False)]
    plain.append(train_iteration(rows[1], plain[0].out_path, tmp_path / "torch-2", config, 1, progress=False))
    previous = policy
    for iteration in (0, 1):
        out = tmp_path / f"ds-{iteration + 1}"
        _torchrun_train(warehouse, iteration, previous, out, EXAMPLES / f"zero{stage}.json", (*lora, *extra))
        ours, theirs = _adapter(out), _adapter(plain[iteration].out_path)
        assert ours.keys() == theirs.keys() and len(ours) == 2 * 14  # A and B of every linear layer
        assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) < TOLERANCE
        merged = _max_difference(AutoModelForCausalLM.from_pretrained(out), load_policy(plain[iteration].out_path))
        assert merged < TOLERANCE
        previous = out
    assert max((a - b).abs().max().item() for a, b in zip(_adapter(previous).values(),
                                                          _adapter(plain[0].out_path).values(), strict=True)) > 1e-4
    steps = warehouse.connect().sql(
        "SELECT loss, grad_norm, approx_kl FROM train_steps ORDER BY iteration, step").fetchall()
    torch_steps = [s for result in plain for s in result.steps]
    assert [loss for loss, *_ in steps] == pytest.approx([s.loss for s in torch_steps], abs=1e-5)
    assert [norm for _, norm, _ in steps] == pytest.approx([s.grad_norm for s in torch_steps], rel=1e-5)
    assert steps[-1][2] > 0  # the policy has moved from its old log-probs
