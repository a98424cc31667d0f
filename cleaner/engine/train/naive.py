"""The full-logits micro batch: the train step written the plain way, as the oracle of the real one.

Rows are right-padded into (B, T) tensors, the whole model runs with an attention mask, and the
(B, T, V) logits give every position's log-probs and entropy (`loss.token_log_probs`,
`loss.entropy_from_logits`). It holds about four float32 copies of tokens x vocabulary, so the
trainer never uses it: tests check the packed, chunked step (`step.forward_micro_batch`) against
it, and bench/train_memory.py measures both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cleaner.config import TrainConfig
from cleaner.engine.train.aggregation import BatchTotals, Rows
from cleaner.engine.train.logprobs import TokenOutputs
from cleaner.engine.train.loss import entropy_from_logits, token_log_probs
from cleaner.engine.train.step import MicroLoss, micro_batch_loss
from cleaner.records import PurifiedRow

PAD_TOKEN_ID = 0  # padding is masked out of attention and loss, so its id does not matter


@dataclass(frozen=True)
class PaddedBatch:
    token_ids: torch.Tensor  # (B, T) int64, right-padded
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) float32, 0 at t = 0 and on padding
    old_log_probs: torch.Tensor  # (B, T) float32
    behavior_log_probs: torch.Tensor  # (B, T) float32
    advantages: torch.Tensor  # (B, T) float32: the row's advantage, or its per-token advantages
    is_weights: torch.Tensor | None = None  # (B, T) float32: rollout correction's IS weights; None: off

    @property
    def row_index(self) -> torch.Tensor:
        """(B, T): token t of row b is in row b."""
        return Rows.padded(self.loss_mask).index

    @property
    def row_count(self) -> int:
        return self.loss_mask.shape[0]


def collate_rows(rows: Sequence[PurifiedRow], device: str | torch.device = "cpu",
                 is_weights: Mapping[int, Sequence[float]] | None = None) -> PaddedBatch:
    """Right-pad rows into tensors on `device`; `is_weights` as `packing.pack_rows` takes them."""
    length = max(len(row.token_ids) for row in rows)

    def pad(values: Sequence, fill, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(v) + [fill] * (length - len(v)) for v in values], dtype=dtype,
                            device=device)

    loss_mask = pad([row.loss_mask for row in rows], 0, torch.float32)
    loss_mask[:, 0] = 0.0
    return PaddedBatch(
        token_ids=pad([row.token_ids for row in rows], PAD_TOKEN_ID, torch.int64),
        attention_mask=pad([[1] * len(row.token_ids) for row in rows], 0, torch.int64),
        loss_mask=loss_mask,
        old_log_probs=pad([row.old_logprobs for row in rows], 0.0, torch.float32),
        behavior_log_probs=pad([row.behavior_logprobs for row in rows], 0.0, torch.float32),
        advantages=pad([row.token_advantages or (row.advantage,) * len(row.token_ids) for row in rows],
                       0.0, torch.float32),
        is_weights=pad([is_weights.get(id(row), (1.0,) * len(row.token_ids)) for row in rows], 1.0, torch.float32)
        if is_weights and any(id(row) in is_weights for row in rows) else None,
    )


def full_logits_outputs(model: torch.nn.Module, batch: PaddedBatch) -> TokenOutputs:
    """Log-probs and entropy at every position from the (B, T, V) logits; (B, T) each."""
    logits = model(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    return TokenOutputs(log_probs=token_log_probs(logits, batch.token_ids),
                        entropy=entropy_from_logits(logits))


def full_logits_micro_batch_loss(model: torch.nn.Module, reference: torch.nn.Module | None,
                                 rows: Sequence[PurifiedRow], config: TrainConfig, totals: BatchTotals,
                                 is_weights: Mapping[int, Sequence[float]] | None = None) -> MicroLoss:
    """`step.forward_micro_batch` on padded rows and full logits (entropy differentiable, as the
    chunked step makes it when entropy_coef > 0)."""
    device = next(model.parameters()).device
    batch = collate_rows(rows, device, is_weights)
    outputs = full_logits_outputs(model, batch)
    reference_log_probs = None
    if reference is not None and config.kl_coef > 0:
        with torch.no_grad():
            reference_log_probs = full_logits_outputs(reference, batch).log_probs
    if config.entropy_coef == 0:
        outputs = TokenOutputs(outputs.log_probs, outputs.entropy.detach())
    return micro_batch_loss(outputs, reference_log_probs, batch, config, totals)
