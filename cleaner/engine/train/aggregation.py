"""verl's loss aggregation (`agg_loss` of the reference's verl, 0.7.0.dev) over one micro batch's
share of a mini batch (docs/architecture.md §7).

verl's new engine aggregates each micro batch with the mini batch's global batch information
(`global_batch_info`: the loss tokens and rows of the mini batch over every rank, and
seq-mean-token-sum-norm's constant), so the micro batches' values add up to the mini batch's:

    token-mean               sum of the loss tokens' values / the mini batch's loss tokens
    seq-mean-token-sum       sum over its rows of each row's token sum / the mini batch's rows
    seq-mean-token-mean      sum over its rows of each row's token mean / the mini batch's rows
    seq-mean-token-sum-norm  sum over its rows of each row's token sum / constant / the mini batch's rows

Design decisions:
- A row is whole in one micro batch, so what seq-mean-token-mean needs of it (its token count) is
  the micro batch's own: each value carries its row (`Rows.index`).
- A row without loss tokens counts among the rows, as verl's global_batch_size counts every row of
  the mini batch, and adds 0; seq-mean-token-mean divides a row's sum by its count + 1e-8, as verl.
- seq-mean-token-sum-norm is Dr.GRPO's, as the reference's verl computes it: the mean over rows of
  each row's token sum divided by the constant (`loss_scale_factor`). verl's v0.7.0 release divides
  the batch's token sum by the constant alone, no longer by the rows: that is not followed here.
- The constant is a number, not the padded response length verl defaults to, since packed rows have
  no padding (TrainConfig.scale_factor: the response budget unless given).
- The value is the mini batch's on any number of ranks: a DeepSpeed rank's share is multiplied by
  the world size, which DeepSpeed's mean over ranks cancels (deepspeed_engine.py), as verl
  multiplies token-mean by dp_size. (The reference's verl divides seq-mean by global_batch_size x
  dp_size, then averages over ranks: dp_size^2 too small on several ranks; its v0.7.0 multiplies.)
- A denominator is at least 1: a mini batch without a loss token has loss 0, not nan. Masked
  values are replaced by 0 before they are summed (verl's masked_sum), so garbage there is inert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SEQ_MEAN_EPS = 1e-8  # verl's guard of a row's token count in seq-mean-token-mean


@dataclass(frozen=True)
class BatchTotals:
    """What a micro batch's share is divided by: verl's global_batch_info of its mini batch."""

    loss_tokens: float  # batch_num_tokens: the mini batch's loss tokens over every rank
    rows: int  # global_batch_size: the mini batch's rows over every rank, with or without loss tokens
    scale_factor: float = 1.0  # loss_scale_factor: seq-mean-token-sum-norm's constant


@dataclass(frozen=True)
class Rows:
    """Where a micro batch's per-token values sit: (M,) at the loss tokens of packed rows, or (B, T)."""

    index: torch.Tensor  # int64, the values' shape: each value's row within the micro batch
    count: int  # rows of the micro batch, with or without loss tokens
    mask: torch.Tensor  # the values' shape: 1 where a value counts (a loss token)

    @classmethod
    def padded(cls, mask: torch.Tensor) -> Rows:
        """The rows of a (B, T) batch: row b is batch row b."""
        index = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)  # (B, T)
        return cls(index=index, count=mask.shape[0], mask=mask)

    def masked(self, values: torch.Tensor) -> torch.Tensor:
        """`values` with 0 wherever the mask is (verl's masked_sum: nan there cannot leak)."""
        return torch.where(self.mask > 0, values, 0.0) * self.mask

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Each row's sum of its counted values. (count,)"""
        flat = self.masked(values).reshape(-1)
        return torch.zeros(self.count, dtype=flat.dtype, device=flat.device).index_add(0, self.index.reshape(-1), flat)

    def tokens(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each row's counted values (its loss tokens), in `dtype` (default: the mask's). (count,)"""
        return self.sums(torch.ones_like(self.mask, dtype=dtype))


def _token_mean(values: torch.Tensor, rows: Rows, totals: BatchTotals) -> torch.Tensor:
    return rows.masked(values).sum() / max(totals.loss_tokens, 1)


def _seq_mean_token_sum(values: torch.Tensor, rows: Rows, totals: BatchTotals) -> torch.Tensor:
    return rows.masked(values).sum() / max(totals.rows, 1)


def _seq_mean_token_mean(values: torch.Tensor, rows: Rows, totals: BatchTotals) -> torch.Tensor:
    return (rows.sums(values) / (rows.tokens(values.dtype) + SEQ_MEAN_EPS)).sum() / max(totals.rows, 1)


def _seq_mean_token_sum_norm(values: torch.Tensor, rows: Rows, totals: BatchTotals) -> torch.Tensor:
    return (rows.sums(values) / totals.scale_factor).sum() / max(totals.rows, 1)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, Rows, BatchTotals], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(values: torch.Tensor, rows: Rows, mode: str, totals: BatchTotals) -> torch.Tensor:
    """The micro batch's share of the mini batch's `mode` aggregate of per-token `values`: a scalar."""
    return AGGREGATIONS[mode](values, rows, totals)


def row_mean(per_row: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    """The micro batch's share of the mean over the mini batch's rows of one value per row."""
    return per_row.sum() / max(totals.rows, 1)
