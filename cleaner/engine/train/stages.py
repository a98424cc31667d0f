"""The stages both training engines share: rows -> mini batches -> micro batches -> loss.

    prepare_rows (skip infra-fault rows and rows with no loss tokens, dynamic sampling, overlong
    shaping)
    -> iter_mini_batches (seeded shuffle; one mini batch = one optimiser step)
    -> chunks of micro batches (right-padded by collate_rows; gradient accumulation)
    -> micro_batch_loss (policy loss + optional KL, normalised by the MINI batch's loss tokens)

The torch engine (`trainer.py`) and the DeepSpeed engine (`deepspeed_engine.py`) each run these
stages with their own optimiser step, so both train the same objective on the same batches.

Design decisions:
- Old log-probs are `row.old_logprobs` from the scorer (docs/architecture.md §6); training never
  recomputes them. Log-prob of token t comes from the logits at t-1; the loss counts only where
  loss_mask[t] == 1 (position 0 never counts: nothing predicts it).
- Each micro batch's loss is divided by the total loss tokens of its mini batch, so the summed
  micro-batch gradients equal one big batch's token-mean gradient (a tested property).
- Dynamic sampling filters on the rows' outcome rewards BEFORE overlong shaping (verl's DAPO
  filters on accuracy too); overlong shaping then adds the soft penalty to the reward and
  recomputes GRPO advantages within each group (eps = PurifyConfig's default 1e-6).
- The KL reference (kl_coef > 0) is always the frozen policy at the iteration's input checkpoint.
- Advantages are per token: a row's `token_advantages` when purify set them (negative-sample
  pushes), else its advantage on every token. Negative samples never count in a group: dynamic
  sampling judges groups by their other rows (a dropped group takes its negatives along), and
  overlong shaping leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.purify.advantages import grpo_advantages
from cleaner.engine.train.loss import (
    dynamic_sampling_mask,
    entropy_from_logits,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    token_log_probs,
    truncated_is_weights,
)
from cleaner.engine.train.optim import Optimization
from cleaner.records import PurifiedRow, TrainStepRow

logger = logging.getLogger(__name__)

OVERLONG_ADVANTAGE_EPS = 1e-6  # GRPO eps when overlong shaping recomputes advantages
PAD_TOKEN_ID = 0  # padding is masked out of attention and loss, so its id does not matter


@dataclass(frozen=True)
class TrainResult:
    out_path: Path  # the new checkpoint directory
    steps: list[TrainStepRow]  # one per optimiser step
    model: torch.nn.Module | None  # the trained model, in memory (None: DeepSpeed's, maybe partitioned)
    optimization: Optimization | None  # the run's optimiser, bound to `model` (None: DeepSpeed's own)
    main_process: bool = True  # False on DeepSpeed's other ranks: they print and write nothing


# ---------------------------------------------------------------------------
# Rows -> mini batches


def loss_token_count(row: PurifiedRow) -> int:
    """Tokens of the row that are trained (position 0 never is)."""
    return sum(row.loss_mask[1:])


def _shape_overlong(rows: list[PurifiedRow], config: TrainConfig) -> list[PurifiedRow]:
    """Rewards with DAPO's overlong penalty and their group advantages, for the rows that are not
    negative samples (those keep their pushes and stay out of the groups)."""
    shaped = [row for row in rows if not row.is_negative]
    if not shaped:
        return rows
    lengths = torch.tensor([len(row.token_ids) - row.prompt_len for row in shaped])
    penalties = overlong_penalty(lengths, config.max_response_tokens, config.overlong_buffer)
    rewards = torch.tensor([row.reward for row in shaped]) + penalties  # (B,)
    advantages = grpo_advantages([row.group_id for row in shaped], rewards.tolist(), OVERLONG_ADVANTAGE_EPS)
    replaced = {id(row): _with_advantage(row, float(reward), float(advantage))
                for row, reward, advantage in zip(shaped, rewards.tolist(), advantages, strict=True)}
    return [replaced.get(id(row), row) for row in rows]


def _with_advantage(row: PurifiedRow, reward: float, advantage: float) -> PurifiedRow:
    """The row with a new reward and advantage; per-token pushes move along with the advantage."""
    tokens = row.token_advantages
    if tokens is not None:
        tokens = tuple(value - row.advantage + advantage for value in tokens)
    return dataclasses.replace(row, reward=reward, advantage=advantage, token_advantages=tokens)


def prepare_rows(rows: Sequence[PurifiedRow], config: TrainConfig) -> list[PurifiedRow]:
    """The rows that are trained on, in input order, with shaped advantages when configured."""
    kept = [row for row in rows if not row.infra_fault]
    if len(kept) < len(rows):
        logger.info("skipped %d rows that an infrastructure fault ended", len(rows) - len(kept))
    with_tokens = [row for row in kept if loss_token_count(row) > 0]
    if len(with_tokens) < len(kept):
        logger.info("skipped %d rows with no loss tokens", len(kept) - len(with_tokens))
    kept = with_tokens
    if config.dynamic_sampling and kept:
        groups = [row for row in kept if not row.is_negative]  # negatives have no say in a group
        keep = dynamic_sampling_mask(
            [row.group_id for row in groups], torch.tensor([r.reward for r in groups])
        )
        kept_groups = {row.group_id for row, k in zip(groups, keep.tolist(), strict=True) if k}
        logger.info("dynamic sampling dropped %d rows in equal-reward groups", int((~keep).sum()))
        kept = [row for row in kept if row.group_id in kept_groups]
    if config.overlong_buffer > 0 and kept:
        kept = _shape_overlong(kept, config)
    return kept


def iter_mini_batches(
    rows: Sequence[PurifiedRow], config: TrainConfig, iteration: int
) -> Iterator[list[PurifiedRow]]:
    """Seeded shuffle per epoch, then consecutive chunks of mini_batch_size rows.

    The shuffle starts from the rows sorted by (rollout, negative sample), not from their input
    order, so the mini batches depend only on which rows there are: two purify configs that give
    the same rows (or the rows read back from the warehouse on resume) train identically, and arms
    of an experiment with the same seed differ only by what purification changed."""
    canonical = sorted(rows, key=lambda row: (row.rollout_id, -1 if row.negative_seq is None else row.negative_seq))
    for epoch in range(config.epochs):
        order = list(canonical)
        random.Random(f"{config.seed}:{iteration}:{epoch}").shuffle(order)
        for start in range(0, len(order), config.mini_batch_size):
            yield order[start : start + config.mini_batch_size]


def chunks(rows: Sequence[PurifiedRow], size: int) -> Iterator[Sequence[PurifiedRow]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


# ---------------------------------------------------------------------------
# Micro batch -> loss


@dataclass(frozen=True)
class MicroBatch:
    token_ids: torch.Tensor  # (B, T) int64, right-padded
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) float32, 0 at t = 0 and on padding
    old_log_probs: torch.Tensor  # (B, T) float32
    behavior_log_probs: torch.Tensor  # (B, T) float32
    advantages: torch.Tensor  # (B, T) float32: the row's advantage, or its per-token advantages


def collate_rows(rows: Sequence[PurifiedRow], device: str | torch.device) -> MicroBatch:
    """Right-pad rows into tensors on `device`."""
    length = max(len(row.token_ids) for row in rows)

    def pad(values: Sequence, fill, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(v) + [fill] * (length - len(v)) for v in values], dtype=dtype)

    loss_mask = pad([row.loss_mask for row in rows], 0, torch.float32)
    loss_mask[:, 0] = 0.0
    batch = MicroBatch(
        token_ids=pad([row.token_ids for row in rows], PAD_TOKEN_ID, torch.int64),
        attention_mask=pad([[1] * len(row.token_ids) for row in rows], 0, torch.int64),
        loss_mask=loss_mask,
        old_log_probs=pad([row.old_logprobs for row in rows], 0.0, torch.float32),
        behavior_log_probs=pad([row.behavior_logprobs for row in rows], 0.0, torch.float32),
        advantages=pad([row.token_advantages or (row.advantage,) * len(row.token_ids) for row in rows],
                       0.0, torch.float32),
    )
    return MicroBatch(
        **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)}
    )


@dataclass(frozen=True)
class MicroLoss:
    loss: torch.Tensor  # scalar, differentiable; already divided by the mini batch's loss tokens
    clip_fraction: float  # this micro batch's share of the mini-batch value (they add up)
    approx_kl: float  # likewise
    entropy: float  # likewise


def micro_batch_loss(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: MicroBatch,
    config: TrainConfig,
    num_loss_tokens: int,
) -> MicroLoss:
    """Forward one micro batch; the loss is normalised by the mini batch's `num_loss_tokens`."""
    logits = model(
        input_ids=batch.token_ids, attention_mask=batch.attention_mask
    ).logits  # (B, T, V)
    log_probs = token_log_probs(logits, batch.token_ids)  # (B, T)
    is_weights = None
    if config.truncated_is:
        is_weights = truncated_is_weights(
            batch.old_log_probs, batch.behavior_log_probs, config.is_cap
        )
    out = policy_loss(
        log_probs,
        batch.old_log_probs,
        batch.advantages,
        batch.loss_mask,
        config.clip_eps_low,
        config.clip_eps_high,
        is_weights,
        num_loss_tokens,
        clip_ratio_c=config.clip_ratio_c or None,
    )
    loss = out.loss
    if config.kl_coef > 0 and reference is not None:
        with torch.no_grad():
            ref_logits = reference(
                input_ids=batch.token_ids, attention_mask=batch.attention_mask
            ).logits
            ref_log_probs = token_log_probs(ref_logits, batch.token_ids)  # (B, T)
        loss = loss + config.kl_coef * kl_penalty(
            log_probs, ref_log_probs, batch.loss_mask, num_loss_tokens
        )
    with torch.no_grad():
        entropy = entropy_from_logits(logits)  # (B, T)
        entropy_share = (entropy * batch.loss_mask).sum() / max(num_loss_tokens, 1)
    return MicroLoss(
        loss=loss,
        clip_fraction=out.clip_fraction.item(),
        approx_kl=out.approx_kl.item(),
        entropy=entropy_share.item(),
    )


def load_reference(policy_path: str | Path, config: TrainConfig) -> torch.nn.Module | None:
    """The frozen KL reference (the policy at policy_path), or None when kl_coef is 0."""
    if config.kl_coef <= 0:
        return None
    reference = load_policy(policy_path, config.device).eval()
    reference.requires_grad_(False)
    return reference
