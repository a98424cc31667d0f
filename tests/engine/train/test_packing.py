"""How a mini batch's rows are shared among ranks and cut into micro batches (engine/train/packing.py),
against assignments worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleaner.engine.train.packing import loss_token_count, micro_batches, pack_rows, rank_share
from tests.factories import make_purified


def _rows(lengths: list[int]):
    """Rows r0, r1, ... with these many tokens each."""
    base = make_purified("c")
    return [dataclasses.replace(base, rollout_id=f"r{i}", token_ids=tuple(range(n)), loss_mask=(0,) + (1,) * (n - 1),
                                behavior_logprobs=(0.0,) * n, old_logprobs=(0.0,) * n)
            for i, n in enumerate(lengths)]


def _ids(rows) -> list[str]:
    return [row.rollout_id for row in rows]


@pytest.mark.parametrize(("rank", "expected"), [(0, ["r0", "r2", "r4"]), (1, ["r1", "r3"])])
def test_without_balancing_a_rank_takes_every_world_size_th_row(rank, expected):
    assert _ids(rank_share(_rows([5, 3, 8, 1, 4]), rank, 2, balance_tokens=False)) == expected


def test_balancing_gives_each_row_longest_first_to_the_rank_with_fewest_tokens():
    """Lengths 5, 3, 8, 1, 4 longest first: r2 (8) to rank 0 (a tie goes to the lower rank), r0 (5)
    to rank 1, r4 (4) to rank 1 (5 < 8), r1 (3) to rank 0 (8 < 9), r3 (1) to rank 1 (9 < 11)."""
    rows = _rows([5, 3, 8, 1, 4])
    assert _ids(rank_share(rows, 0, 2, balance_tokens=True)) == ["r2", "r1"]
    assert _ids(rank_share(rows, 1, 2, balance_tokens=True)) == ["r0", "r4", "r3"]


def test_balancing_breaks_ties_by_row_order_then_by_the_lower_rank():
    rows = _rows([2, 2, 2, 2, 2])
    assert [_ids(rank_share(rows, rank, 3, balance_tokens=True)) for rank in range(3)] == [
        ["r0", "r3"], ["r1", "r4"], ["r2"]]


@pytest.mark.parametrize("balance", [False, True])
def test_the_shares_of_all_ranks_hold_every_row_once(balance):
    rows = _rows([7, 1, 4, 4, 9, 2, 6, 3])
    shares = [_ids(rank_share(rows, rank, 3, balance)) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(_ids(rows))
    if balance:  # 9, 7, 6 open the ranks; 4 to rank 2 (6), 4 to rank 1 (7), 3 to rank 0 (9), 2 to rank 2 (10),
        # 1 to rank 1 (11 < 12): 12 tokens each
        assert shares == [["r4", "r7"], ["r0", "r3", "r1"], ["r6", "r2", "r5"]]


def test_micro_batches_without_a_budget_are_consecutive_chunks():
    assert [_ids(batch) for batch in micro_batches(_rows([5, 3, 8, 1, 4]), 2, None)] == [
        ["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_a_token_budget_packs_first_fit_decreasing():
    """Budget 9, lengths 5, 3, 8, 1, 4 longest first: r2 (8) opens a batch (1 left), r0 (5) a
    second (4 left), r4 (4) fills it exactly, r1 (3) opens a third, r3 (1) fills the first."""
    assert [_ids(batch) for batch in micro_batches(_rows([5, 3, 8, 1, 4]), 2, 9)] == [
        ["r2", "r3"], ["r0", "r4"], ["r1"]]


def test_a_row_past_the_budget_is_a_micro_batch_alone_and_ties_keep_their_order():
    assert [_ids(batch) for batch in micro_batches(_rows([2, 12]), 2, 9)] == [["r1"], ["r0"]]
    assert [_ids(batch) for batch in micro_batches(_rows([2, 2, 2]), 2, 4)] == [["r0", "r1"], ["r2"]]


def test_a_rows_trained_tokens_never_count_its_first():
    row = dataclasses.replace(_rows([4])[0], loss_mask=(1, 1, 0, 1))
    assert loss_token_count(row) == 2


def test_two_rows_pack_end_to_end_with_the_loss_inputs_at_their_loss_tokens():
    """Worked by hand: rows of 3 and 2 tokens, the second's first token marked but never predicted.
    The flat loss tokens are 1, 2 and 4, each predicted from the position before; the bounds that
    varlen attention reads on a GPU (`cu_seq_lens`, int32) equal the rows' (what the CPU can see of
    flash attention's path)."""
    base = make_purified("c")
    first = dataclasses.replace(base, token_ids=(10, 11, 12), loss_mask=(0, 1, 1), old_logprobs=(0.0, -0.1, -0.2),
                                behavior_logprobs=(0.0, -0.3, -0.4), advantage=0.5)
    second = dataclasses.replace(base, rollout_id="r1", token_ids=(20, 21), loss_mask=(1, 1), old_logprobs=(0.0, -0.5),
                                 behavior_logprobs=(0.0, -0.6), advantage=0.1, token_advantages=(0.7, 0.8))
    batch = pack_rows([first, second])
    assert batch.token_ids.tolist() == [10, 11, 12, 20, 21] and batch.token_ids.dtype == torch.int64
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert batch.row_lengths == (3, 2) and batch.row_count == 2 and batch.row_bounds == (0, 3, 5)
    assert batch.cu_seq_lens.tolist() == [0, 3, 5] and batch.cu_seq_lens.dtype == torch.int32
    assert batch.predictor_index.tolist() == [0, 1, 3] and batch.target_ids.tolist() == [11, 12, 21]
    assert batch.row_index.tolist() == [0, 0, 1]
    torch.testing.assert_close(batch.old_log_probs, torch.tensor([-0.1, -0.2, -0.5]))
    torch.testing.assert_close(batch.behavior_log_probs, torch.tensor([-0.3, -0.4, -0.6]))
    torch.testing.assert_close(batch.advantages, torch.tensor([0.5, 0.5, 0.8]))  # the row's, or its per-token one
    assert batch.is_weights is None


def test_a_packed_batch_moves_every_tensor_to_the_device_and_keeps_the_rest():
    batch = pack_rows(_rows([3, 2]), is_weights=None)
    moved = batch.to("meta")  # a device every machine has, which no tensor starts on
    for item in dataclasses.fields(moved):
        value = getattr(moved, item.name)
        if isinstance(value, torch.Tensor):
            assert value.device.type == "meta", item.name
    assert moved.row_lengths == batch.row_lengths and moved.is_weights is None
    assert pack_rows(_rows([3, 2]), "meta").token_ids.device.type == "meta"  # packed for the device asked


def test_rollout_correction_weights_are_gathered_at_the_loss_tokens_and_a_row_without_them_weighs_one():
    first, second = _rows([3, 2])
    batch = pack_rows([first, second], is_weights={id(first): (9.0, 0.5, 2.0)})  # loss tokens: 1, 2 and 4
    torch.testing.assert_close(batch.is_weights, torch.tensor([0.5, 2.0, 1.0]))
    assert pack_rows([first, second], is_weights={id(object()): (1.0,)}).is_weights is None  # none of these rows'
