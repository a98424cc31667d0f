"""How a mini batch's rows are shared among ranks and cut into micro batches (engine/train/packing.py),
against assignments worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from cleaner.engine.train.packing import loss_token_count, micro_batches, rank_share
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
