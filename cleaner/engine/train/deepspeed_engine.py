"""DeepSpeed ZeRO behind the trainer's interface (engine = "deepspeed"; docs/architecture.md §7).

UNVERIFIED: written against the DeepSpeed API (deepspeed/__init__.py `initialize`, runtime/engine.py
`backward`, `step`, `save_16bit_model`, `get_global_grad_norm`, `get_lr`) but never run here: no
GPU and no deepspeed in this environment. Its test is @pytest.mark.gpu.

Launch with the DeepSpeed launcher (`deepspeed --num_gpus N ...`), which sets the ranks.

Design decisions:
- The same stages as the torch trainer (`prepare_rows`, `iter_mini_batches`, `micro_batch_loss`),
  so both engines compute the same objective. Every rank sees every row in the same seeded order
  and trains on its share `mini_rows[rank::world_size]`.
- Gradient accumulation is DeepSpeed's: the JSON's `train_micro_batch_size_per_gpu`,
  `gradient_accumulation_steps`, `train_batch_size` and `gradient_clipping` are set from
  TrainConfig (micro_batch_size, ceil(mini_batch_size / (micro_batch_size * world)), max_grad_norm)
  and `engine.step()` is called after every micro batch; DeepSpeed steps at the boundary. A rank
  whose share is short of a full accumulation cycle runs padding micro batches with loss * 0, so
  every rank reaches the boundary together.
- Token-mean across ranks: each micro loss is divided by the loss tokens of the WHOLE mini batch
  (every rank knows it) and multiplied by world_size, because DeepSpeed averages gradients over
  ranks; `backward(..., scale_wrt_gas=False)` because our normalisation already covers accumulation.
- The optimiser is torch AdamW (a ZeRO-supported client optimiser) unless the JSON names one.
- Saving: every rank calls `engine.save_16bit_model` into a staging directory beside out_path
  (ZeRO-3 needs `stage3_gather_16bit_weights_on_model_save: true`); rank 0 then assembles a
  Hugging Face directory (weights + config + tokenizer) atomically at out_path.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cleaner.engine.config import TrainConfig
from cleaner.engine.models import load_policy, load_tokenizer_if_present
from cleaner.engine.records import PurifiedRow, TrainStepRow
from cleaner.engine.train.checkpoint import atomic_directory
from cleaner.engine.train.stages import (
    TrainResult,
    chunks,
    collate_rows,
    iter_mini_batches,
    loss_token_count,
    micro_batch_loss,
    prepare_rows,
)

logger = logging.getLogger(__name__)

WEIGHTS_FILENAME = "pytorch_model.bin"  # what save_16bit_model writes; from_pretrained reads it

# ---------------------------------------------------------------------------
# Configuration


def deepspeed_config_for(config: TrainConfig, world_size: int) -> dict:
    """The user's DeepSpeed JSON with batch sizes and clipping taken from TrainConfig."""
    ds_config = json.loads(Path(config.deepspeed_config).read_text())
    accumulation = math.ceil(config.mini_batch_size / (config.micro_batch_size * world_size))
    ds_config["train_micro_batch_size_per_gpu"] = config.micro_batch_size
    ds_config["gradient_accumulation_steps"] = accumulation
    ds_config["train_batch_size"] = config.micro_batch_size * accumulation * world_size
    ds_config["gradient_clipping"] = config.max_grad_norm
    return ds_config


def _initialize(model: torch.nn.Module, config: TrainConfig):
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    deepspeed.init_distributed()
    world_size = deepspeed.comm.get_world_size()
    ds_config = deepspeed_config_for(config, world_size)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )
    return engine


# ---------------------------------------------------------------------------
# One optimiser step across ranks


def _rank_micro_batches(
    mini_rows: Sequence[PurifiedRow],
    rank: int,
    world_size: int,
    micro_batch_size: int,
    accumulation: int,
) -> list[tuple[Sequence[PurifiedRow], float]]:
    """This rank's micro batches, padded to `accumulation` with zero-weight repeats."""
    share = list(mini_rows[rank::world_size]) or [mini_rows[0]]
    weight = 1.0 if mini_rows[rank::world_size] else 0.0
    micro = [(rows, weight) for rows in chunks(share, micro_batch_size)]
    return micro + [(share[:1], 0.0)] * (accumulation - len(micro))


def _deepspeed_step(engine, reference, mini_rows, config, iteration, step) -> TrainStepRow:
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    world_size, rank = deepspeed.comm.get_world_size(), deepspeed.comm.get_rank()
    total_tokens = sum(loss_token_count(row) for row in mini_rows)
    optimizer_step = int(engine.global_steps)
    accumulation = engine.gradient_accumulation_steps()
    sums = torch.zeros(4, device=engine.device)  # loss, clip fraction, approx kl, entropy
    for rows, weight in _rank_micro_batches(
        mini_rows, rank, world_size, config.micro_batch_size, accumulation
    ):
        part = micro_batch_loss(
            engine, reference, collate_rows(rows, engine.device), config, total_tokens
        )
        engine.backward(part.loss * (weight * world_size), scale_wrt_gas=False)
        engine.step()
        sums += weight * torch.tensor(
            [part.loss.item(), part.clip_fraction, part.approx_kl, part.entropy],
            device=engine.device,
        )
    deepspeed.comm.all_reduce(sums)  # each rank holds its share of the mini-batch means
    loss, clip_fraction, approx_kl, entropy = sums.tolist()
    grad_norm = engine.get_global_grad_norm()
    return TrainStepRow(
        iteration=iteration,
        step=step,
        optimizer_step=optimizer_step,
        loss=loss,
        clip_fraction=clip_fraction,
        approx_kl=approx_kl,
        entropy=entropy,
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        lr=float(engine.get_lr()[0]),
        tokens=total_tokens,
    )


# ---------------------------------------------------------------------------
# Save and the iteration


def _save(engine, policy_path: str | Path, out_path: str | Path, config: TrainConfig) -> Path:
    """All ranks gather 16-bit weights; rank 0 assembles the HF directory atomically."""
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    out_path = Path(out_path).resolve()
    staging = out_path.parent / f".{out_path.name}.deepspeed-staging"
    if not engine.save_16bit_model(str(staging), WEIGHTS_FILENAME):
        raise RuntimeError(
            "save_16bit_model saved nothing: with ZeRO-3 set "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save = true"
        )
    deepspeed.comm.barrier()
    if deepspeed.comm.get_rank() == 0:
        tokenizer = load_tokenizer_if_present(policy_path)
        with atomic_directory(out_path) as temp_dir:
            shutil.move(str(staging / WEIGHTS_FILENAME), temp_dir / WEIGHTS_FILENAME)
            engine.module.config.save_pretrained(temp_dir)
            if getattr(engine.module, "generation_config", None) is not None:
                engine.module.generation_config.save_pretrained(temp_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(temp_dir)
            (temp_dir / "train_config.json").write_text(config.to_json())
        shutil.rmtree(staging, ignore_errors=True)
    deepspeed.comm.barrier()
    return out_path


def train_iteration_deepspeed(
    rows: Sequence[PurifiedRow],
    policy_path: str | Path,
    out_path: str | Path,
    config: TrainConfig,
    iteration: int,
    model: torch.nn.Module | None = None,
    progress: bool = True,
) -> TrainResult:
    """`trainer.train_iteration` on DeepSpeed ZeRO; every rank calls it with the same rows."""
    torch.manual_seed(config.seed)
    train_rows = prepare_rows(rows, config)
    engine = _initialize(model if model is not None else load_policy(policy_path), config)
    engine.train()
    reference = None
    if config.kl_coef > 0:
        reference = load_policy(policy_path, engine.device).eval().requires_grad_(False)
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    show = progress and deepspeed.comm.get_rank() == 0
    steps: list[TrainStepRow] = []
    mini_batches = list(iter_mini_batches(train_rows, config, iteration))
    for step, mini_rows in enumerate(
        tqdm(mini_batches, desc=f"train iteration {iteration}", unit="step", disable=not show)
    ):
        steps.append(_deepspeed_step(engine, reference, mini_rows, config, iteration, step))
    engine.eval()
    saved = _save(engine, policy_path, out_path, config)
    return TrainResult(out_path=saved, steps=steps, model=engine.module, optimization=None)
