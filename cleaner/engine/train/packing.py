"""Rows -> micro batches -> one packed, padding-free sequence (docs/architecture.md §7).

A micro batch is a list of rows: a fixed number of them (`micro_batch_size`), or as many as fit in
a token budget (`max_tokens_per_micro_batch`, verl's ppo_max_token_len_per_gpu); a row longer than
the budget forms a micro batch alone, never truncated. Its rows are laid end to end in one
sequence with per-row positions (`PackedBatch`), so no token is padding, and every per-token
quantity the loss needs is gathered at the loss tokens only: a micro batch of N tokens with M loss
tokens keeps (M,) vectors, and the lm_head runs on M hidden states, not N (no logits at prompt or
tool-output positions).

Alignment: flat position i holds token i of its row; the loss token at i is predicted by the hidden
state at i - 1, which is in the same row because a row's first token never trains. Each loss token
also carries its row's index in the micro batch (`row_index`), which sequence-level losses and
aggregations sum over.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from cleaner.records import PurifiedRow


def loss_token_count(row: PurifiedRow) -> int:
    """Tokens of the row that are trained (position 0 never is)."""
    return sum(row.loss_mask[1:])


# ---------------------------------------------------------------------------
# Rows -> micro batches


def micro_batches(rows: Sequence[PurifiedRow], micro_batch_size: int,
                  max_tokens: int | None) -> list[list[PurifiedRow]]:
    """The micro batches of a (rank's share of a) mini batch, in a deterministic order.

    Without a token budget: consecutive chunks of `micro_batch_size` rows. With one: first-fit
    decreasing by length, each micro batch holding at most `max_tokens` tokens (a longer row alone).
    """
    if max_tokens is None:
        return [list(rows[start : start + micro_batch_size]) for start in range(0, len(rows), micro_batch_size)]
    bins: list[list[PurifiedRow]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r.token_ids)):  # stable: ties keep their order
        length = len(row.token_ids)
        slot = next((i for i, free in enumerate(room) if free >= length), None)
        if slot is None:
            bins.append([row])
            room.append(max_tokens - length)
        else:
            bins[slot].append(row)
            room[slot] -= length
    return bins


def rank_share(rows: Sequence[PurifiedRow], rank: int, world_size: int,
               balance_tokens: bool) -> list[PurifiedRow]:
    """The rows of a mini batch that `rank` trains on: every world_size-th row, or (balance_tokens)
    the longest-first assignment of each row to the rank with the fewest tokens so far."""
    if not balance_tokens:
        return list(rows[rank::world_size])
    loads = [0] * world_size
    mine = []
    for index in sorted(range(len(rows)), key=lambda i: -len(rows[i].token_ids)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += len(rows[index].token_ids)
        if owner == rank:
            mine.append(rows[index])
    return mine


# ---------------------------------------------------------------------------
# Micro batch -> tensors


@dataclass(frozen=True)
class PackedBatch:
    """One micro batch's rows end to end (N tokens), with what the loss needs at its M loss tokens."""

    token_ids: torch.Tensor  # (N,) int64: the rows' tokens, one row after another
    position_ids: torch.Tensor  # (N,) int64: each token's position within its row
    row_lengths: tuple[int, ...]  # tokens of each row, in order: they sum to N
    cu_seq_lens: torch.Tensor  # (R + 1,) int32: where each row starts, then N (varlen attention's bounds)
    predictor_index: torch.Tensor  # (M,) int64: flat position of the hidden state predicting each loss token
    target_ids: torch.Tensor  # (M,) int64: the loss tokens
    old_log_probs: torch.Tensor  # (M,) float32: log pi_old of each loss token (the scorer's)
    behavior_log_probs: torch.Tensor  # (M,) float32: log pi of the sampling context
    advantages: torch.Tensor  # (M,) float32: the row's advantage, or its per-token one
    row_index: torch.Tensor  # (M,) int64: the row of each loss token, 0 .. R - 1 (seq-level losses and aggregation)
    is_weights: torch.Tensor | None = None  # (M,) float32: rollout correction's IS weights; None: off

    @property
    def row_count(self) -> int:
        """R: the rows, with or without loss tokens."""
        return len(self.row_lengths)

    @property
    def row_bounds(self) -> tuple[int, ...]:
        """Where each row starts, then N: `cu_seq_lens` on the host, for attention to read without a sync."""
        return (0, *itertools.accumulate(self.row_lengths))

    @property
    def loss_mask(self) -> torch.Tensor:
        """(M,) ones: every gathered position is a loss token (the loss takes masked inputs)."""
        return torch.ones_like(self.old_log_probs)

    def to(self, device: str | torch.device) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return PackedBatch(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                              for name, value in moved.items()})


def pack_rows(rows: Sequence[PurifiedRow], device: str | torch.device = "cpu",
              is_weights: Mapping[int, Sequence[float]] | None = None) -> PackedBatch:
    """Lay the rows end to end; gather the per-token inputs of the loss at the loss tokens.
    `is_weights`: rollout correction's per-token weights by id(row), aligned with each row's tokens."""
    token_ids, positions, loss_mask, old, behavior, advantages, rows_of = [], [], [], [], [], [], []
    for index, row in enumerate(rows):
        length = len(row.token_ids)
        token_ids.extend(row.token_ids)
        positions.extend(range(length))
        loss_mask.extend((0, *row.loss_mask[1:]))  # a row's first token is never predicted
        old.extend(row.old_logprobs)
        behavior.extend(row.behavior_logprobs)
        advantages.extend(row.token_advantages or (row.advantage,) * length)
        rows_of.extend((index,) * length)
    flat_ids = torch.tensor(token_ids, dtype=torch.int64)  # (N,)
    loss_index = torch.tensor(loss_mask, dtype=torch.bool).nonzero().squeeze(-1)  # (M,)

    def at_loss(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[loss_index]  # (M,)

    row_lengths = tuple(len(row.token_ids) for row in rows)
    batch = PackedBatch(
        token_ids=flat_ids, position_ids=torch.tensor(positions, dtype=torch.int64), row_lengths=row_lengths,
        cu_seq_lens=torch.tensor([0, *itertools.accumulate(row_lengths)], dtype=torch.int32),
        predictor_index=loss_index - 1,
        target_ids=flat_ids[loss_index], old_log_probs=at_loss(old),
        behavior_log_probs=at_loss(behavior), advantages=at_loss(advantages),
        row_index=torch.tensor(rows_of, dtype=torch.int64)[loss_index],
        is_weights=_weights_at_loss(rows, is_weights, at_loss))
    return batch.to(device)


def _weights_at_loss(rows: Sequence[PurifiedRow], is_weights: Mapping[int, Sequence[float]] | None,
                     at_loss: Callable[[list[float]], torch.Tensor]) -> torch.Tensor | None:
    """The rows' IS weights at their loss tokens (1 for a row without any); None when none has."""
    if not is_weights or not any(id(row) in is_weights for row in rows):
        return None
    return at_loss([weight for row in rows for weight in is_weights.get(id(row), (1.0,) * len(row.token_ids))])
