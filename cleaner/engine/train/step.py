"""One training step, shared by both engines: rows -> mini batches -> micro batches -> loss -> a row.

    prepare_rows (skip infra-fault rows, dynamic sampling, overlong shaping, rollout correction)
    -> iter_mini_batches (seeded shuffle; one mini batch = one optimiser step)
    -> packing.micro_batches (by rows or by a token budget) -> packing.pack_rows (padding-free)
    -> forward_micro_batch (TrainablePolicy: log-probs and entropy at the loss tokens only)
    -> micro_batch_loss (the loss mode's policy loss + optional KL and entropy terms, each
       aggregated as loss_agg_mode says with the MINI batch's totals: its loss tokens and rows)
    -> StepMetrics (the micro batches' values summed into the step's TrainStepRow)

The torch engine (`trainer.py`) and the DeepSpeed engine (`deepspeed_engine.py`) each run these
stages with their own optimiser step, so both train the same objective on the same batches.

Design decisions:
- Old log-probs are `row.old_logprobs` from the scorer (docs/architecture.md §6); training never
  recomputes them. Log-prob of token t comes from the logits at t-1; the loss counts only where
  loss_mask[t] == 1 (position 0 never counts: nothing predicts it).
- Each micro batch's loss is its share of the mini batch's aggregate (`batch_totals`: the mini
  batch's loss tokens, its rows, seq-mean-token-sum-norm's constant), so the summed micro-batch
  gradients equal one big batch's, whatever the aggregation (tested against verl's functions on the
  padded mini batch: tests/engine/train/test_objectives.py).
- A row without loss tokens, from the warehouse or emptied by rollout correction's rejection,
  stays in the batch with its zero mask, as verl keeps it: the mini batches, the number of optimiser
  steps and the token-mean denominators are verl's whatever is rejected (a mini batch of such rows
  is a step with a zero gradient, AdamW's decay and moments still moving).
- Dynamic sampling filters on the rows' outcome rewards BEFORE overlong shaping (verl's DAPO
  filters on accuracy too); overlong shaping then adds the soft penalty to the reward and
  recomputes the advantages with the purify config's estimator (its eps, its std switch); a
  batch-wide estimator (reinforce_plus_plus_baseline) is also recomputed over the rows dynamic
  sampling keeps, as verl whitens the batch it trains on.
- Rollout correction's IS weights travel beside the rows (`Corrected.is_weights`) into the packed
  batch and the policy loss, which composes them as verl's loss mode does.
- Each step's row holds the total `loss` and verl's actor/* terms apart: pg_loss, kl_loss (null
  without a KL term, as verl logs none), entropy, and the policy loss's metrics.
- The KL reference (kl_coef > 0) is the frozen policy at the iteration's input checkpoint; with LoRA,
  the base with the adapters disabled (lora.py).
- Rows a purify config's down-sampling dropped (RoC, uniform) leave the batch, as rStar filters its
  batch; rows the void-turn filter masked stay, with a zero mask, as SimpleTIR's do.
- Advantages are per token: a row's `token_advantages` when purify set them (negative-sample
  pushes), else its advantage on every token. Negative samples never count in a group: dynamic
  sampling judges groups by their other rows (a dropped group takes its negatives along), and
  overlong shaping leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.train.aggregation import BatchTotals, Rows, aggregate
from cleaner.engine.train.flops import model_flops_utilisation
from cleaner.engine.train.logprobs import TokenOutputs
from cleaner.engine.train.loss import (
    POLICY_LOSSES,
    Clip,
    Surrogate,
    dynamic_sampling_mask,
    k3_kl,
    overlong_penalty,
)
from cleaner.engine.train.optim import Optimization
from cleaner.engine.train.packing import PackedBatch, loss_token_count, micro_batches, pack_rows
from cleaner.engine.train.policy import TrainablePolicy, load_reference
from cleaner.engine.train.rollout_correction import Corrected, correct
from cleaner.records import PurifiedRow, TrainStepRow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    out_path: Path  # the new checkpoint directory
    steps: list[TrainStepRow]  # one per optimiser step
    model: torch.nn.Module | None  # the trained model, in memory (None: DeepSpeed's, maybe partitioned)
    optimization: Optimization | None  # the run's optimiser, bound to `model` (None: DeepSpeed's own)
    main_process: bool = True  # False on DeepSpeed's other ranks: they print and write nothing


# ---------------------------------------------------------------------------
# Rows -> mini batches


def _reestimated(rows: list[PurifiedRow], config: TrainConfig, purify: PurifyConfig) -> list[PurifiedRow]:
    """The rows that are not negative samples with DAPO's overlong penalty in their rewards (none
    with overlong_buffer 0) and their advantages recomputed by the purify config's estimator over
    these rows; negative samples keep their pushes and stay out of the groups."""
    from cleaner.engine.purify.advantages import advantages  # polars: the step runs without it

    shaped = [row for row in rows if not row.is_negative]
    if not shaped:
        return rows
    lengths = torch.tensor([len(row.token_ids) - row.prompt_len for row in shaped])
    penalties = overlong_penalty(lengths, config.max_response_tokens, config.overlong_buffer)
    rewards = torch.tensor([row.reward for row in shaped]) + penalties  # (B,)
    values = advantages(purify, [row.group_id for row in shaped], rewards.tolist(),
                        [loss_token_count(row) for row in shaped])
    replaced = {id(row): _with_advantage(row, float(reward), float(advantage))
                for row, reward, advantage in zip(shaped, rewards.tolist(), values, strict=True)}
    return [replaced.get(id(row), row) for row in rows]


def _with_advantage(row: PurifiedRow, reward: float, advantage: float) -> PurifiedRow:
    """The row with a new reward and advantage; per-token pushes move along with the advantage."""
    tokens = row.token_advantages
    if tokens is not None:
        tokens = tuple(value - row.advantage + advantage for value in tokens)
    return dataclasses.replace(row, reward=reward, advantage=advantage, token_advantages=tokens)


def longest_row(rows: Sequence[PurifiedRow]) -> int:
    """Tokens of the longest row."""
    return max((len(row.token_ids) for row in rows), default=0)


def longest_micro_batch_tokens(rows: Sequence[PurifiedRow], config: TrainConfig) -> int:
    """Tokens of the largest micro batch the rows can make: a token budget's (or the longest row,
    alone), else micro_batch_size of the longest rows."""
    if config.max_tokens_per_micro_batch is not None:
        return max(config.max_tokens_per_micro_batch, longest_row(rows))
    lengths = sorted((len(row.token_ids) for row in rows), reverse=True)
    return sum(lengths[: config.micro_batch_size])


def prepare_rows(rows: Sequence[PurifiedRow], config: TrainConfig,
                 purify: PurifyConfig | None = None) -> list[PurifiedRow]:
    """The rows that are trained on (`prepare`'s)."""
    return prepare(rows, config, purify).rows


def prepare(rows: Sequence[PurifiedRow], config: TrainConfig, purify: PurifyConfig | None = None) -> Corrected:
    """The rows that are trained on, in input order, with shaped advantages when configured (by the
    estimator of `purify`, the config that computed the rows' advantages; default: GRPO's) and
    rollout correction applied (rollout_correction.py): its IS weights and the iteration's metrics."""
    return correct(_shaped(rows, config, purify or PurifyConfig()), config)


def with_rollout_corr(steps: list[TrainStepRow], metrics: dict[str, float]) -> list[TrainStepRow]:
    """The steps' rows, each with its iteration's rollout-correction metrics (JSON)."""
    text = json.dumps(metrics, sort_keys=True) if metrics else None
    return [dataclasses.replace(step, rollout_corr=text) for step in steps]


def _shaped(rows: Sequence[PurifiedRow], config: TrainConfig, purify: PurifyConfig) -> list[PurifiedRow]:
    """The rows that are trained on, in input order, with shaped advantages when configured."""
    kept = [row for row in rows if not row.infra_fault]
    if len(kept) < len(rows):
        logger.info("skipped %d rows that an infrastructure fault ended", len(rows) - len(kept))
    sampled = [row for row in kept if not row.dropped]  # down-sampling's choice: out of the batch, as rStar's
    if len(sampled) < len(kept):
        logger.info("left out %d rows that down-sampling dropped", len(kept) - len(sampled))
    kept = sampled
    empty = sum(loss_token_count(row) == 0 for row in kept)
    if empty:
        logger.info("%d rows have no loss tokens: kept with a zero mask, as verl keeps them", empty)
    if config.dynamic_sampling and kept:
        groups = [row for row in kept if not row.is_negative]  # negatives have no say in a group
        keep = dynamic_sampling_mask(
            [row.group_id for row in groups], torch.tensor([r.reward for r in groups])
        )
        kept_groups = {row.group_id for row, k in zip(groups, keep.tolist(), strict=True) if k}
        logger.info("dynamic sampling dropped %d rows in equal-reward groups", int((~keep).sum()))
        kept = [row for row in kept if row.group_id in kept_groups]
    # a batch-wide estimator whitens over the rows kept, as verl computes advantages after filtering
    if kept and (config.overlong_buffer > 0 or (config.dynamic_sampling and purify.whole_batch)):
        kept = _reestimated(kept, config, purify)
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


# ---------------------------------------------------------------------------
# Micro batch -> loss


class LossTokens(Protocol):
    """The per-token inputs of the loss, all of one shape: (M,) at a packed batch's loss tokens, or
    (B, T) padded with a loss mask (the full-logits reference, `naive.py`)."""

    old_log_probs: torch.Tensor
    behavior_log_probs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    row_index: torch.Tensor  # each token's row within the micro batch
    is_weights: torch.Tensor | None  # rollout correction's IS weights; None: off

    @property
    def row_count(self) -> int: ...


def batch_totals(mini_rows: Sequence[PurifiedRow], config: TrainConfig) -> BatchTotals:
    """What every micro batch of a mini batch is normalised by, on every rank: its loss tokens, its
    rows (each with or without loss tokens) and seq-mean-token-sum-norm's constant."""
    return BatchTotals(loss_tokens=sum(loss_token_count(row) for row in mini_rows), rows=len(mini_rows),
                       scale_factor=config.scale_factor)


@dataclass(frozen=True)
class MicroLoss:
    """A micro batch's loss and its shares of the reported values, all 0-dim tensors on the device:
    nothing is read back to the host before the optimiser step's row (StepMetrics). Each share is
    already divided by the mini batch's totals, so the micro batches' shares add up to its value."""

    loss: torch.Tensor  # differentiable: pg_loss + kl_coef x kl_loss - entropy_coef x entropy
    pg_loss: torch.Tensor  # verl's actor/pg_loss
    kl_loss: torch.Tensor  # actor/kl_loss: the aggregated k3 KL to the reference (0 without one)
    entropy: torch.Tensor  # actor/entropy: the aggregated entropy
    clip_fraction: torch.Tensor  # actor/pg_clipfrac (a token mean, whatever the aggregation)
    clip_fraction_lower: torch.Tensor  # actor/pg_clipfrac_lower
    approx_kl: torch.Tensor  # k3 of KL(pi_old || pi), a token mean
    ppo_kl: torch.Tensor  # actor/ppo_kl, a token mean


def micro_batch_loss(outputs: TokenOutputs, reference_log_probs: torch.Tensor | None, tokens: LossTokens,
                     config: TrainConfig, totals: BatchTotals) -> MicroLoss:
    """The objective of one micro batch from its log-probs and entropy, as verl's ppo_loss composes
    it: the loss mode's policy loss + kl_coef x the k3 KL to the reference - entropy_coef x the
    entropy, the KL and the entropy aggregated as the policy loss is (`config.aggregation`), each
    normalised by the mini batch's `totals`; rollout correction's IS weights go to the policy loss."""
    rows = Rows(index=tokens.row_index, count=tokens.row_count, mask=tokens.loss_mask)
    surrogate = Surrogate(outputs.log_probs, tokens.old_log_probs, tokens.advantages, rows, tokens.is_weights)
    clip = Clip(config.clip_eps_low, config.clip_eps_high, config.clip_ratio_c or None)
    out = POLICY_LOSSES[config.loss_mode](surrogate, clip, config.aggregation, totals)
    loss, kl = out.loss, torch.zeros((), device=out.loss.device)
    if config.kl_coef > 0 and reference_log_probs is not None:
        kl = aggregate(k3_kl(rows.masked(reference_log_probs - outputs.log_probs)), rows, config.aggregation, totals)
        loss = loss + config.kl_coef * kl
    entropy = aggregate(outputs.entropy, rows, config.aggregation, totals)
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * entropy
    return MicroLoss(loss=loss, pg_loss=out.loss.detach(), kl_loss=kl.detach(), entropy=entropy.detach(),
                     clip_fraction=out.clip_fraction, clip_fraction_lower=out.clip_fraction_lower,
                     approx_kl=out.approx_kl, ppo_kl=out.ppo_kl)


def forward_micro_batch(policy: Callable[[PackedBatch], TokenOutputs], reference: Reference | None,
                        rows: Sequence[PurifiedRow], batch: PackedBatch, config: TrainConfig,
                        totals: BatchTotals) -> MicroLoss:
    """Forward one packed micro batch (`rows`, packed) through the policy (a TrainablePolicy, or the
    DeepSpeed engine over one), and its loss against the reference's log-probs (computed before the
    iteration; with LoRA the base's, in the micro batch: lora.AdapterReference)."""
    reference_log_probs = None
    if reference is not None and config.kl_coef > 0:  # first: its forward's memory is free before the policy's
        reference_log_probs = reference.log_probs(rows, batch)  # (M,)
    outputs = policy(batch)  # (M,) each
    return micro_batch_loss(outputs, reference_log_probs, batch, config, totals)


# ---------------------------------------------------------------------------
# The KL reference: its log-probs once per iteration


class Reference(Protocol):
    """The KL reference's log-probs at a packed micro batch's loss tokens: `ReferenceLogProbs`, or
    with LoRA the policy's base (lora.AdapterReference)."""

    def log_probs(self, rows: Sequence[PurifiedRow], batch: PackedBatch) -> torch.Tensor: ...


class ReferenceLogProbs:
    """The frozen reference's log-probs at every loss token of the rows an iteration trains on,
    computed once before the policy trains (in the compute dtype, micro batches packed by tokens)
    and kept on the host: no epoch or micro batch forwards the reference again, and its weights are
    freed before the policy's optimiser state is built, so the two never share the device."""

    def __init__(self, values: dict[int, torch.Tensor]) -> None:
        self.values = values  # id(row) -> (M_row,) float32 on the host

    def of(self, rows: Sequence[PurifiedRow], device: str | torch.device) -> torch.Tensor:
        """The log-probs of `rows`' loss tokens, in pack_rows' order. (M,)"""
        return torch.cat([self.values[id(row)] for row in rows]).to(device)

    def log_probs(self, rows: Sequence[PurifiedRow], batch: PackedBatch) -> torch.Tensor:
        """`of(rows)` on the batch's device. (M,)"""
        return self.of(rows, batch.target_ids.device)

    @classmethod
    @torch.no_grad()
    def compute(cls, reference: TrainablePolicy, rows: Sequence[PurifiedRow], config: TrainConfig,
                device: str | torch.device) -> ReferenceLogProbs:
        budget = config.max_tokens_per_micro_batch or max(config.micro_batch_size * longest_row(rows), 1)
        unique = list({id(row): row for row in rows}.values())
        values: dict[int, torch.Tensor] = {}
        for micro_rows in micro_batches(unique, config.micro_batch_size, budget):
            log_probs = reference(pack_rows(micro_rows, device)).log_probs.float().cpu()  # (M,)
            for row, part in zip(micro_rows, log_probs.split([loss_token_count(r) for r in micro_rows]),
                                 strict=True):
                values[id(row)] = part
        return cls(values)

    @classmethod
    def of_checkpoint(cls, policy_path: str | Path, rows: Sequence[PurifiedRow], config: TrainConfig,
                      device: str | torch.device) -> ReferenceLogProbs | None:
        """Load the reference saved at `policy_path`, compute, free it; None when kl_coef is 0."""
        if config.kl_coef <= 0:
            return None
        reference = load_reference(policy_path, config, device)
        try:
            return cls.compute(reference, rows, config, device)
        finally:
            del reference
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()  # its blocks go back before the policy's optimiser state is built


# ---------------------------------------------------------------------------
# Micro losses -> the step's row


METRICS = ("loss", "pg_loss", "kl_loss", "entropy", "clip_fraction", "clip_fraction_lower", "approx_kl", "ppo_kl")


class StepMetrics:
    """The reported values of one optimiser step, summed over its micro batches (and ranks) on the
    device, and read back once, for its row."""

    def __init__(self, sums: torch.Tensor | None = None) -> None:
        self.sums = sums  # (len(METRICS),) float64, in METRICS' order; None before any

    def add(self, part: MicroLoss, weight: float = 1.0) -> None:
        values = torch.stack([getattr(part, name).detach() for name in METRICS]).double()
        self.sums = weight * values if self.sums is None else self.sums + weight * values

    def tensor(self, device: str | torch.device) -> torch.Tensor:
        """The sums as one float64 tensor, for an all-reduce over ranks; `from_tensor` reads it back."""
        if self.sums is None:
            return torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        return self.sums.to(device)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> StepMetrics:
        return cls(values)

    def row(self, iteration: int, step: int, optimizer_step: int, grad_norm: float, lr: float,
            tokens: int, kl: bool = False) -> TrainStepRow:
        """The step's row; `kl`: whether a KL term was in the loss (else kl_loss is null, as verl logs none)."""
        values = dict(zip(METRICS, self.tensor("cpu").tolist(), strict=True))  # the step's one read
        return TrainStepRow(iteration=iteration, step=step, optimizer_step=optimizer_step, loss=values["loss"],
                            clip_fraction=values["clip_fraction"], approx_kl=values["approx_kl"],
                            entropy=values["entropy"], grad_norm=grad_norm, lr=lr, tokens=tokens,
                            pg_loss=values["pg_loss"], kl_loss=values["kl_loss"] if kl else None,
                            ppo_kl=values["ppo_kl"], clip_fraction_lower=values["clip_fraction_lower"])


def timed(row: TrainStepRow, model: torch.nn.Module, mini_rows: Sequence[PurifiedRow], started: float,
          world_size: int = 1) -> TrainStepRow:
    """The step's row with its wall time and, on a GPU whose peak flops.py knows, its model FLOPs
    utilisation as verl counts it: the model work of the mini batch's rows, shared by `world_size`
    GPUs."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's kernels, AdamW's included, have run
    seconds = time.perf_counter() - started
    mfu = None
    if device.type == "cuda":
        mfu = model_flops_utilisation(model.config, [len(row.token_ids) for row in mini_rows], seconds * world_size,
                                      torch.cuda.get_device_name(device))
    return dataclasses.replace(row, seconds=seconds, mfu=mfu)
