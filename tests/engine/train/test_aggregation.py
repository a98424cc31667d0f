"""verl's loss aggregation (engine/train/aggregation.py) against hand-computed values: a micro batch's
share of its mini batch under each mode, the shares adding up, masked garbage inert. Against verl's
agg_loss itself, through the train step: test_objectives.py."""

from __future__ import annotations

import pytest
import torch

from cleaner.config import LOSS_AGG_MODES
from cleaner.engine.train.aggregation import AGGREGATIONS, BatchTotals, Rows, aggregate, row_mean

# a mini batch of three rows over two micro batches: row a (values 1, 2), row b (3), row c (no loss
# token) in the first; row d (4, 4, 4) in the second. 6 loss tokens, 4 rows.
TOTALS = BatchTotals(loss_tokens=6, rows=4, scale_factor=2.0)
FIRST = (torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), Rows(torch.tensor([0, 0, 1]), 3, torch.ones(3)))
SECOND = (torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64), Rows(torch.tensor([0, 0, 0]), 1, torch.ones(3)))
EXPECTED = {  # the mini batch's value, and the first micro batch's share of it
    "token-mean": (18 / 6, 6 / 6),
    "seq-mean-token-sum": ((3 + 3 + 0 + 12) / 4, 6 / 4),
    "seq-mean-token-mean": ((1.5 / (1 + 5e-9) + 3 / (1 + 1e-8) + 0 + 4 / (1 + 1e-8 / 3)) / 4,
                            (1.5 / (1 + 5e-9) + 3 / (1 + 1e-8)) / 4),
    "seq-mean-token-sum-norm": ((3 / 2 + 3 / 2 + 0 + 12 / 2) / 4, 3 / 4),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_mode_by_hand_and_the_shares_add_up_to_the_mini_batchs_value(mode):
    whole, first = EXPECTED[mode]
    share = aggregate(*FIRST, mode, TOTALS)
    assert share.item() == pytest.approx(first, rel=1e-12)
    assert (share + aggregate(*SECOND, mode, TOTALS)).item() == pytest.approx(whole, rel=1e-12)


def test_a_padded_batch_is_its_own_rows_and_garbage_at_masked_positions_is_inert():
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    rows = Rows.padded(mask)
    assert rows.index.tolist() == [[0, 0, 0], [1, 1, 1]] and rows.count == 2
    assert rows.sums(values).tolist() == [3.0, 3.0] and rows.tokens().tolist() == [2.0, 1.0]
    totals = BatchTotals(loss_tokens=3, rows=2, scale_factor=4.0)
    assert aggregate(values, rows, "token-mean", totals).item() == pytest.approx(2.0)
    assert aggregate(values, rows, "seq-mean-token-mean", totals).item() == pytest.approx(
        (3 / (2 + 1e-8) + 3 / (1 + 1e-8)) / 2, rel=1e-12)
    assert aggregate(values, rows, "seq-mean-token-sum-norm", totals).item() == pytest.approx(6 / 4 / 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_mini_batch_of_one_row_and_one_token_is_its_own_denominator(mode):
    value = aggregate(torch.tensor([3.0], dtype=torch.float64), Rows(torch.tensor([0]), 1, torch.ones(1)), mode,
                      BatchTotals(loss_tokens=1, rows=1, scale_factor=1.0))
    assert value.item() == pytest.approx(3.0 / (1 + 1e-8) if mode == "seq-mean-token-mean" else 3.0, rel=1e-12)


def test_a_mini_batch_without_loss_tokens_aggregates_to_zero():
    rows = Rows(torch.zeros(0, dtype=torch.int64), 2, torch.ones(0))
    empty = BatchTotals(loss_tokens=0, rows=0)
    for mode in LOSS_AGG_MODES:
        assert aggregate(torch.zeros(0), rows, mode, empty).item() == 0.0
    assert row_mean(torch.zeros(2), empty).item() == 0.0


def test_row_mean_divides_by_the_mini_batchs_rows_and_every_mode_has_its_function():
    assert row_mean(torch.tensor([1.0, 2.0]), BatchTotals(loss_tokens=5, rows=8)).item() == pytest.approx(3 / 8)
    assert set(AGGREGATIONS) == set(LOSS_AGG_MODES)
    gradient = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    aggregate(gradient, FIRST[1], "seq-mean-token-mean", TOTALS).backward()
    assert gradient.grad.tolist() == pytest.approx([1 / (2 + 1e-8) / 4] * 2 + [1 / (1 + 1e-8) / 4], rel=1e-6)


@pytest.mark.gpu
def test_a_gpu_batchs_rows_and_sums_stay_on_its_device():
    """On the CPU a tensor built without a device is where the mask is; on a GPU it would not be."""
    mask = torch.ones(2, 3, device="cuda")
    rows = Rows.padded(mask)
    assert rows.index.device == mask.device
    assert rows.sums(torch.ones(2, 3, device="cuda")).device == mask.device
    assert aggregate(torch.ones(2, 3, device="cuda"), rows, "seq-mean-token-mean",
                     BatchTotals(loss_tokens=6, rows=2)).item() == pytest.approx(1.0, rel=1e-6)
