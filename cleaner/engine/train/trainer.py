"""The torch training engine: one iteration on purified rows, a new Hugging Face checkpoint out.

    stages.prepare_rows -> stages.iter_mini_batches -> micro batches (stages.micro_batch_loss,
    backward) -> gradient clipping -> AdamW step -> one TrainStepRow per step
    -> save_checkpoint_atomic (weights, tokenizer and the optimiser state, in one swap).

`train_iteration` is also the entry point for both engines: engine = "deepspeed" hands the same
stages, optimiser and schedule to `deepspeed_engine.py` (docs/architecture.md §7), which always
resumes its optimiser from the checkpoint at `policy_path` (an `optimization` passed in is the torch
engine's and is not used).

Design decisions:
- A step whose gradient norm is not finite is skipped (grads dropped) and logged, not applied.
- `model` may be passed in so `cleaner run` needs no reload.
- One optimiser for the run (`optim.py`): `cleaner run` passes the same `Optimization` to every
  iteration; otherwise the one saved with `policy_path` is resumed. Each step's row records the
  run-wide `optimizer_step` and the lr it used.
- With nothing left to train on, the unchanged policy is still saved, so a loop can go on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy, load_tokenizer_if_present
from cleaner.engine.train.checkpoint import save_checkpoint_atomic
from cleaner.engine.train.deepspeed_engine import train_iteration_deepspeed
from cleaner.engine.train.optim import STATE_PATH, Optimization, load_optimization
from cleaner.engine.train.stages import (
    MicroLoss,
    TrainResult,
    chunks,
    collate_rows,
    iter_mini_batches,
    load_reference,
    loss_token_count,
    micro_batch_loss,
    prepare_rows,
)
from cleaner.records import PurifiedRow, TrainStepRow

logger = logging.getLogger(__name__)


def _optimizer_step(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimization: Optimization,
    mini_rows: Sequence[PurifiedRow],
    config: TrainConfig,
    iteration: int,
    step: int,
) -> TrainStepRow:
    total_tokens = sum(loss_token_count(row) for row in mini_rows)
    optimization.optimizer.zero_grad(set_to_none=True)
    parts: list[MicroLoss] = []
    for micro_rows in chunks(mini_rows, config.micro_batch_size):
        part = micro_batch_loss(
            model, reference, collate_rows(micro_rows, config.device), config, total_tokens
        )
        part.loss.backward()
        parts.append(dataclasses.replace(part, loss=part.loss.detach()))
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    if not math.isfinite(grad_norm):
        logger.warning(
            "iteration %d step %d: gradient norm %s, step skipped", iteration, step, grad_norm
        )
    row = TrainStepRow(
        iteration=iteration,
        step=step,
        optimizer_step=optimization.step,
        loss=sum(p.loss.item() for p in parts),
        clip_fraction=sum(p.clip_fraction for p in parts),
        approx_kl=sum(p.approx_kl for p in parts),
        entropy=sum(p.entropy for p in parts),
        grad_norm=grad_norm,
        lr=optimization.lr,
        tokens=total_tokens,
    )
    optimization.advance(apply=math.isfinite(grad_norm))
    return row


def train_iteration(
    rows: Sequence[PurifiedRow],
    policy_path: str | Path,
    out_path: str | Path,
    config: TrainConfig,
    iteration: int,
    model: torch.nn.Module | None = None,
    progress: bool = True,
    optimization: Optimization | None = None,
) -> TrainResult:
    """Train the policy on one iteration's purified rows and save it atomically at out_path.

    `optimization` is the run's optimiser, bound to `model`; without one, the optimiser saved with
    `policy_path` is loaded (or a fresh one made, if that checkpoint has none).
    """
    if config.engine == "deepspeed":
        return train_iteration_deepspeed(
            rows, policy_path, out_path, config, iteration, model, progress
        )
    torch.manual_seed(config.seed)
    train_rows = prepare_rows(rows, config)
    if not train_rows:
        logger.warning("iteration %d: no rows to train on; saving the policy unchanged", iteration)
    model = (model if model is not None else load_policy(policy_path, config.device)).to(
        config.device
    )
    model.train()
    reference = load_reference(policy_path, config)
    if optimization is None:
        optimization = load_optimization(model, config, policy_path)
    mini_batches = list(iter_mini_batches(train_rows, config, iteration))
    steps: list[TrainStepRow] = []
    bar = tqdm(mini_batches, desc=f"train iteration {iteration}", unit="step", disable=not progress)
    for step, mini_rows in enumerate(bar):
        row = _optimizer_step(model, reference, optimization, mini_rows, config, iteration, step)
        steps.append(row)
        bar.set_postfix(loss=f"{row.loss:.4f}", clip=f"{row.clip_fraction:.3f}")
    model.eval()
    saved = save_checkpoint_atomic(
        model,
        load_tokenizer_if_present(policy_path),
        out_path,
        extra_files={"train_config.json": config.to_json()},
        state_files={STATE_PATH: optimization.state()},
    )
    return TrainResult(out_path=saved, steps=steps, model=model, optimization=optimization)
