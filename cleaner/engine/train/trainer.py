"""The torch training engine: one iteration on purified rows, a new Hugging Face checkpoint out.

    step.prepare_rows -> step.iter_mini_batches -> per mini batch: packing.micro_batches ->
    per micro batch: pack_rows -> step.forward_micro_batch -> backward -> StepMetrics
    -> gradient clipping -> AdamW step -> one TrainStepRow per step
    -> save_checkpoint_atomic (weights in --save-dtype, tokenizer and the optimiser state, in one swap).

`train_iteration` is also the entry point for both engines: engine = "deepspeed" hands the same
stages, optimiser and schedule to `deepspeed_engine.py` (docs/architecture.md §7), which always
resumes its optimiser from the checkpoint at `policy_path` (an `optimization` passed in is the torch
engine's and is not used).

Design decisions:
- A step whose gradient norm is not finite is skipped (grads dropped) and logged, not applied;
  an iteration that trained nothing, or broke its weights, saves nothing (outcome.py).
- `model` may be passed in so `cleaner run` needs no reload.
- With a LoRA rank (lora.py) the adapters alone train, the KL reference is the base with them
  disabled, and the checkpoint holds the merged weights and the adapter.
- One optimiser for the run (`optim.py`): `cleaner run` passes the same `Optimization` to every
  iteration; otherwise the one saved with `policy_path` is resumed. Each step's row records the
  run-wide `optimizer_step` and the lr it used.
- With nothing left to train on, the unchanged policy is still saved, so a loop can go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.model.head import check_attention
from cleaner.engine.model.loading import load_tokenizer_if_present
from cleaner.engine.train.checkpoint import save_checkpoint_atomic, save_pretrained_as
from cleaner.engine.train.deepspeed_engine import train_iteration_deepspeed
from cleaner.engine.train.lora import AdapterReference, new_adapters, save_with_adapters
from cleaner.engine.train.optim import STATE_PATH, Optimization, load_optimization, new_optimization
from cleaner.engine.train.outcome import check_trained
from cleaner.engine.train.packing import micro_batches, pack_rows
from cleaner.engine.train.policy import TrainablePolicy, load_trainable, training
from cleaner.engine.train.rollout_correction import Corrected
from cleaner.engine.train.step import (
    Reference,
    ReferenceLogProbs,
    StepMetrics,
    TrainResult,
    batch_totals,
    forward_micro_batch,
    iter_mini_batches,
    longest_row,
    prepare,
    timed,
    with_rollout_corr,
)
from cleaner.records import PurifiedRow, TrainStepRow

logger = logging.getLogger(__name__)


def _optimizer_step(
    policy: TrainablePolicy,
    reference: Reference | None,
    optimization: Optimization,
    mini_rows: Sequence[PurifiedRow],
    prepared: Corrected,
    config: TrainConfig,
    iteration: int,
    step: int,
) -> TrainStepRow:
    """One optimiser step: every micro batch forward and backward, clip, AdamW, the step's row."""
    started = time.perf_counter()
    totals = batch_totals(mini_rows, config)
    optimization.optimizer.zero_grad(set_to_none=True)
    metrics = StepMetrics()
    for micro_rows in micro_batches(mini_rows, config.micro_batch_size, config.max_tokens_per_micro_batch):
        batch = pack_rows(micro_rows, config.device, prepared.is_weights)
        part = forward_micro_batch(policy, reference, micro_rows, batch, config, totals)
        optimization.backward(part.loss)  # scaled under float16
        metrics.add(part)
    optimization.unscale()
    params = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    if not math.isfinite(grad_norm):
        logger.warning(
            "iteration %d step %d: gradient norm %s, step skipped", iteration, step, grad_norm
        )
    row = metrics.row(iteration, step, optimization.step, grad_norm, optimization.lr, int(totals.loss_tokens),
                      kl=config.kl_coef > 0)
    optimization.advance(apply=math.isfinite(grad_norm))
    return timed(row, policy.policy, mini_rows, started)


def _policy_and_reference(rows: Sequence[PurifiedRow], policy_path: str | Path, config: TrainConfig,
                          model: torch.nn.Module | None, optimization: Optimization | None
                          ) -> tuple[TrainablePolicy, Reference | None, Optimization]:
    """The policy to train, its KL reference and its optimiser: the reference's log-probs before the
    policy loads (or with LoRA its own base, adapters disabled), the optimiser given, else the one
    saved with `policy_path` (new adapters start a fresh one)."""
    lora = config.lora_rank > 0
    reference = None if lora else ReferenceLogProbs.of_checkpoint(policy_path, rows, config, config.device)
    fresh = new_adapters(policy_path, config)
    policy = load_trainable(policy_path, config, config.device, model)
    if lora and config.kl_coef > 0:
        reference = AdapterReference(policy, policy)
    check_attention(policy.policy, longest_row(rows))  # a sliding window every row fits in, or one line
    if optimization is None:
        optimization = (new_optimization(policy.policy, config) if fresh
                        else load_optimization(policy.policy, config, policy_path))
    return policy, reference, optimization


def train_iteration(
    rows: Sequence[PurifiedRow],
    policy_path: str | Path,
    out_path: str | Path,
    config: TrainConfig,
    iteration: int,
    model: torch.nn.Module | None = None,
    progress: bool = True,
    optimization: Optimization | None = None,
    purify: PurifyConfig | None = None,
) -> TrainResult:
    """Train the policy on one iteration's purified rows and save it atomically at out_path.

    `optimization` is the run's optimiser, bound to `model`; without one, the optimiser saved with
    `policy_path` is loaded (or a fresh one made, if that checkpoint has none). `purify` is the
    config that computed the rows' advantages: its estimator recomputes them where the step does
    (overlong shaping; default: GRPO's).
    """
    if config.engine == "deepspeed":
        return train_iteration_deepspeed(
            rows, policy_path, out_path, config, iteration, model, progress, purify
        )
    torch.manual_seed(config.seed)
    prepared = prepare(rows, config, purify)
    train_rows = prepared.rows
    if not train_rows:
        logger.warning("iteration %d: no rows to train on; saving the policy unchanged", iteration)
    policy, reference, optimization = _policy_and_reference(train_rows, policy_path, config, model, optimization)
    model = policy.policy
    mini_batches = list(iter_mini_batches(train_rows, config, iteration))
    steps: list[TrainStepRow] = []
    bar = tqdm(mini_batches, desc=f"train iteration {iteration}", unit="step", disable=not progress)
    with training(policy, config):
        for step, mini_rows in enumerate(bar):
            row = _optimizer_step(policy, reference, optimization, mini_rows, prepared, config,
                                  iteration, step)
            steps.append(row)
            bar.set_postfix(loss=f"{row.loss:.4f}", clip=f"{row.clip_fraction:.3f}")
    check_trained(steps, model.named_parameters(), iteration, loss_scaled=optimization.scaler is not None)
    saved = save_checkpoint_atomic(
        model,
        load_tokenizer_if_present(policy_path),
        out_path,
        extra_files={"train_config.json": config.to_json()},
        state_files={STATE_PATH: optimization.state(master_weights=config.save_dtype != "float32" and not config.lora_rank)},
        save_dtype=config.save_dtype,
        save_weights=save_with_adapters if config.lora_rank > 0 else save_pretrained_as,
    )
    return TrainResult(out_path=saved, steps=with_rollout_corr(steps, prepared.metrics), model=model, optimization=optimization)
