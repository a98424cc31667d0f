"""Down-sampling (GRPO-RoC, uniform) and SimpleTIR's void-turn filter, by hand and against the
reference's own selection (tests/rstar_roc.py transcribes rStar's resample_of_correct)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.purify.pipeline import purify_iteration, render_iteration
from cleaner.engine.purify.selection import (
    answer_format_penalty,
    has_void_turn,
    roc_choice,
    roc_penalty,
    select,
    tool_error_ratio,
    uniform_choice,
)
from cleaner.engine.train.step import prepare_rows
from cleaner.records import ToolStatus
from tests.factories import FakeScorer, selection_rollout
from tests.rstar_roc import error_ratio, resample_of_correct_mask

OK, ERROR, TIMEOUT, FORMAT, INFRA = (ToolStatus.OK, ToolStatus.ERROR, ToolStatus.TIMEOUT, ToolStatus.FORMAT_ERROR,
                                     ToolStatus.INFRA_ERROR)


def group(*members, group_id="g"):
    """(rollouts, segments) of one group from (reward, statuses[, answer]) tuples."""
    built = [selection_rollout(i, *member, group_id=group_id) for i, member in enumerate(members)]
    return [rollout for rollout, _ in built], [s for _, segments in built for s in segments]


def grouped(segments):
    out = {}
    for segment in segments:
        out.setdefault(segment.rollout_id, []).append(segment)
    return out


# ----------------------------------------------------------------------------------------------
# Penalties


@pytest.mark.parametrize(("statuses", "expected"), [
    ((ERROR, OK), 0.5),
    ((), 0.5),  # no tool response: the reference's 0.5
    ((INFRA, OK), 0.0),  # an infrastructure fault is neither a response nor a failure
    ((INFRA,), 0.5),
    ((TIMEOUT, FORMAT, OK, OK), 0.5),
    ((ERROR, ERROR, ERROR, OK), 0.75),
])
def test_the_tool_error_ratio_counts_failed_responses_over_responses(statuses, expected):
    _, segments = selection_rollout(0, 1.0, statuses)
    assert tool_error_ratio(segments) == expected


def test_the_error_ratio_is_the_references_where_its_text_rule_reads_cleaners_statuses():
    # the reference counts responses holding "error"; cleaner's failed responses say "reason: error"
    text = ("<tool_response>Tool call failure\nreason: error\nstderr: NameError</tool_response>"
            "<tool_response>Tool call success\nstdout: 3</tool_response>")
    _, segments = selection_rollout(0, 1.0, (ERROR, OK))
    assert tool_error_ratio(segments) == error_ratio(text) == 0.5
    # ... and a timeout's "reason: timeout" is where the two part (selection.py's departure)
    assert error_ratio("<tool_response>Tool call failure\nreason: timeout</tool_response>") == 0.0
    assert tool_error_ratio(selection_rollout(0, 1.0, (TIMEOUT,))[1]) == 1.0


def test_the_format_penalty_is_one_without_an_answer_and_grows_with_repeated_answers():
    _, answered = selection_rollout(0, 1.0, (ERROR, OK))  # 3 assistant turns, one answer
    _, silent = selection_rollout(0, 0.0, (OK,), answer=False)
    assert answer_format_penalty(answered, "toy") == 0.0
    assert answer_format_penalty(silent, "toy") == 1.0
    repeated = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "text": "\\boxed{3} <tool_call>x"})
                for s in answered]  # an answer before the first call too: 2 answers over 3 turns
    assert answer_format_penalty(repeated, "toy") == pytest.approx(1 / 3)
    in_code = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "text": "try <tool_call>print('\\boxed{3}')"})
               for s in answered]  # inside the call: code, not an answer
    assert answer_format_penalty(in_code, "toy") == 0.0
    twice = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "text": "a <tool_call>'\\boxed{3}' b <tool_call>x"})
             for s in answered]  # inside the first of two calls: still code
    assert answer_format_penalty(twice, "toy") == 0.0
    unparsed = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "call_start": None, "text": "<tool_call>\\boxed{3}"})
                for s in answered]  # no call read from the turn: all of its text is the turn's
    assert answer_format_penalty(unparsed, "toy") == pytest.approx(1 / 3)


def test_a_turn_holding_several_answers_costs_at_most_one():
    """Three \\boxed{} in one of three turns: (3 - 1) / 3 turns; in one turn of one, capped at 1."""
    _, answered = selection_rollout(0, 1.0, (ERROR, OK))
    last = answered[-1]
    tripled = [*answered[:-1], last.__class__(**{**last.__dict__, "text": "\\boxed{1} \\boxed{2} \\boxed{3}"})]
    assert answer_format_penalty(tripled, "toy") == pytest.approx(2 / 3)
    assert answer_format_penalty([tripled[0], tripled[-1]], "toy") == 1.0  # the prompt and the answer turn


@pytest.mark.parametrize(("error_ratio_on", "answer_format_on", "expected"), [
    (True, True, 0.5 + 1 / 3), (True, False, 0.5), (False, True, 1 / 3), (False, False, 0.0)])
def test_the_roc_penalty_adds_the_error_ratio_and_the_format_penalty_each_where_switched_on(
        error_ratio_on, answer_format_on, expected):
    """One failed call of two (0.5); two answers over three turns (1/3)."""
    _, answered = selection_rollout(0, 1.0, (ERROR, OK))
    repeated = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "text": "\\boxed{3} <tool_call>x"})
                for s in answered]
    config = PurifyConfig(roc_error_ratio=error_ratio_on, roc_answer_format=answer_format_on)
    assert roc_penalty(repeated, "toy", config) == pytest.approx(expected)


# ----------------------------------------------------------------------------------------------
# Void turns


@pytest.mark.parametrize(("statuses", "answer", "void"), [
    ((OK,), True, False),
    ((OK,), False, True),  # the last turn neither calls nor answers
    ((FORMAT, OK), True, True),  # a call that does not parse, in a turn without an answer
    ((ERROR, OK), True, False),  # a failed call is a complete call
    ((), True, False),
])
def test_a_void_turn_is_one_with_neither_a_complete_call_nor_a_final_answer(statuses, answer, void):
    _, segments = selection_rollout(0, 1.0, statuses, answer)
    assert has_void_turn(segments, "toy") is void


def test_a_call_that_does_not_parse_beside_an_answer_is_not_void():
    _, segments = selection_rollout(0, 1.0, (FORMAT, OK))
    answered = [s if s.seq != 1 else s.__class__(**{**s.__dict__, "text": "\\boxed{4} <tool_call>x"})
                for s in segments]
    assert has_void_turn(answered, "toy") is False


# ----------------------------------------------------------------------------------------------
# RoC's choice of one group, by hand


def test_roc_keeps_the_lowest_penalty_positives_and_the_first_negatives_in_proportion():
    # 16 rows, 5 positives, 11 negatives, keep 8: round(11 / 2) = 6 negatives (Python rounds 5.5 to
    # 6), round(2.5) = 2 positives, at the minimum of 2: the 2 positives of lowest penalty
    rewards = [1.0 if i in (1, 4, 6, 9, 13) else 0.0 for i in range(16)]
    penalties = [0.0] * 16
    penalties[1], penalties[4], penalties[6], penalties[9], penalties[13] = 0.9, 0.1, 0.5, 0.1, 0.0
    chosen = roc_choice(rewards, penalties, 8, 2, 2)
    assert chosen == sorted([13, 4] + [0, 2, 3, 5, 7, 8])  # 4 before 9: a tie keeps sample order


def test_roc_fills_from_the_other_side_when_one_side_has_fewer_than_its_minimum():
    rewards = [1.0] * 15 + [0.0]  # one negative: round(0.5) = 0 -> min(2, 1) = 1 negative, 7 positives
    penalties = [i / 100 for i in range(16)]
    assert roc_choice(rewards, penalties, 8, 2, 2) == [0, 1, 2, 3, 4, 5, 6, 15]
    assert roc_choice([1.0] * 16, penalties, 8, 2, 2) == list(range(8))  # all positive: the 8 lowest


def test_roc_drops_a_group_smaller_than_its_target_and_keeps_one_of_its_size():
    assert roc_choice([1.0, 0.0, 1.0], [0, 0, 0], 4, 2, 2) is None
    assert roc_choice([1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], 4, 2, 2) == [0, 1, 2, 3]


@pytest.mark.parametrize(("rewards", "n", "min_negatives", "min_positives", "kept"), [
    # one of a positive and a negative: round(0.5) = 0 negatives, at their minimum of 0: the positive
    ((1.0, 0.0), 1, 0, 0, [0]),
    # three of two positives and two negatives: round(1.5) = 2 positives, at their minimum of 2
    ((1.0, 1.0, 0.0, 0.0), 3, 0, 2, [0, 1, 2]),
])
def test_roc_at_a_share_equal_to_its_minimum_keeps_what_the_reference_keeps(rewards, n, min_negatives,
                                                                             min_positives, kept):
    """The boundaries `<=` decides (found by brute force against the transcription, which the random
    draws below rarely reach)."""
    penalties = [0.0] * len(rewards)
    assert roc_choice(list(rewards), penalties, n, min_negatives, min_positives) == kept
    expected = resample_of_correct_mask(["g"] * len(rewards), list(rewards), penalties, n, min_negatives, min_positives)
    assert [i in kept for i in range(len(rewards))] == expected


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_roc_keeps_what_the_references_resample_of_correct_keeps(data):
    n = data.draw(st.integers(1, 10))
    min_negatives = data.draw(st.integers(0, n))
    min_positives = data.draw(st.integers(0, n - min_negatives))
    sizes = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))
    uids, rewards, penalties = [], [], []
    for g, size in enumerate(sizes):
        uids += [f"g{g}"] * size
        rewards += data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=size, max_size=size))
        penalties += data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]), min_size=size, max_size=size))
    mine = [False] * len(uids)
    for g in set(uids):
        indices = [i for i, uid in enumerate(uids) if uid == g]
        chosen = roc_choice([rewards[i] for i in indices], [penalties[i] for i in indices], n, min_negatives,
                            min_positives)
        assert chosen is None or len(chosen) == min(n, len(indices)) or len(indices) == n
        for position in chosen or ():
            mine[indices[position]] = True
    try:
        expected = resample_of_correct_mask(uids, rewards, penalties, n, min_negatives, min_positives)
    except AssertionError:  # the reference's shares do not add up to n: it stops; cleaner keeps n (above)
        return
    assert mine == expected


# ----------------------------------------------------------------------------------------------
# Uniform


def test_uniform_keeps_n_members_each_about_equally_often_and_the_same_on_every_replay():
    counts = [0] * 16
    for g in range(2000):
        ids = [f"it0-p{g}-s{i}" for i in range(16)]
        chosen = uniform_choice(ids, 8)
        assert len(chosen) == 8 and chosen == uniform_choice(list(ids), 8)
        for position in chosen:
            counts[position] += 1
    assert all(abs(count / 2000 - 0.5) < 0.05 for count in counts)  # 4.5 sigma of a fair coin
    assert uniform_choice(["a", "b"], 3) is None
    assert uniform_choice(["a", "b", "c"], 3) == [0, 1, 2]  # a group of its size: kept whole


def test_select_uniform_keeps_in_each_group_the_members_uniform_choice_names():
    """Two groups of four in sample order, two kept of each: uniform_choice over each group's
    rollout ids; an infrastructure fault is no candidate, so its group of three keeps two of those."""
    first, first_segments = group((1.0, (OK,)), (0.0, (ERROR,)), (1.0, ()), (0.0, ()), group_id="a")
    second, second_segments = group((1.0, (OK,)), (1.0, (INFRA, OK)), (0.0, ()), (0.0, ()), group_id="b")
    rollouts, segments = first + second, first_segments + second_segments
    config = PurifyConfig(rollback_prob=0.0, down_sample="uniform", down_sample_to=2)
    chosen = select(rollouts, grouped(segments), config, [False] * 5 + [True] + [False] * 2)
    expected = [False] * 8
    for position in uniform_choice([r.rollout_id for r in first], 2):
        expected[position] = True
    candidates = [4, 6, 7]
    for position in uniform_choice([rollouts[i].rollout_id for i in candidates], 2):
        expected[candidates[position]] = True
    assert chosen.kept == tuple(expected) and sum(chosen.kept) == 4


# ----------------------------------------------------------------------------------------------
# A config over an iteration: which rows, their advantages, what is stored and trained


ROC4 = PurifyConfig(rollback_prob=0.0, down_sample="roc", down_sample_to=4)


def test_select_skips_infra_faulted_rollouts_and_counts_groups_too_small():
    rollouts, segments = group((1.0, (OK,)), (0.0, (ERROR,)), (1.0, (INFRA, OK)), (0.0, ()), (1.0, ()))
    chosen = select(rollouts, grouped(segments), ROC4, [False, False, True, False, False])
    assert chosen.kept == (True, True, False, True, True)  # four candidates: all kept
    small = select(rollouts, grouped(segments), ROC4, [False, True, True, False, False])
    assert small.kept == (False,) * 5 and small.groups_dropped == 1
    other, other_segments = group((1.0, (OK,)), (0.0, ()), group_id="h")
    both = select(rollouts + other, grouped(segments + other_segments), ROC4, [False, True, True, False, False] + [False] * 2)
    assert both.groups_dropped == 2  # each group too small counts


def test_a_down_sampled_config_computes_its_advantages_over_the_kept_rows_and_marks_the_others():
    # six rollouts: positives 0 (clean), 1 (one failed call of two), 2 (two of three); negatives 3, 4, 5;
    # keep 4: round(3 * 4 / 6) = 2 of each side, the two cleanest positives
    rollouts, segments = group((1.0, (OK,)), (1.0, (ERROR, OK)), (1.0, (ERROR, ERROR, OK)), (0.0, (OK,)),
                               (0.0, (ERROR, OK)), (0.0, ()))
    rows, stats = render_iteration(rollouts, segments, ROC4, decode=None)
    assert [row.dropped for row in rows] == [False, False, True, False, False, True]
    spread = 0.5 / (math.sqrt(1 / 3) + ROC4.advantage_eps)  # kept rewards 1, 1, 0, 0: sample std sqrt(1/3)
    assert [row.advantage for row in rows] == pytest.approx([spread, spread, 0.0, -spread, -spread, 0.0])
    assert all(set(row.loss_mask) == {0} and set(row.behavior_logprobs) == {0.0} for row in rows if row.dropped)
    assert all(min(row.behavior_logprobs) < 0 for row in rows if not row.dropped)  # the kept rows' own
    assert (stats.n_dropped, stats.n_void) == (2, 0)
    trained = prepare_rows(rows, TrainConfig())
    assert [row.rollout_id for row in trained] == ["g-s0", "g-s1", "g-s3", "g-s4"]  # dropped rows leave the batch


def test_the_void_turn_filter_masks_the_row_and_keeps_it_in_its_group_and_the_batch():
    rollouts, segments = group((1.0, (OK,)), (0.0, (OK,), False), (0.0, (OK,)))
    config = PurifyConfig(rollback_prob=0.0, void_turn_filter=True)
    rows, stats = render_iteration(rollouts, segments, config, decode=None)
    mean, std = 1 / 3, math.sqrt(1 / 3)  # rewards 1, 0, 0: the void row counts in the statistics
    assert [row.advantage for row in rows] == pytest.approx([(r - mean) / (std + 1e-6) for r in (1, 0, 0)])
    assert [row.void_turn for row in rows] == [False, True, False] and stats.n_void == 1
    assert set(rows[1].loss_mask) == {0} and any(rows[0].loss_mask)
    assert [row.rollout_id for row in prepare_rows(rows, TrainConfig())] == ["g-s0", "g-s1", "g-s2"]
    unfiltered, _ = render_iteration(rollouts, segments, PurifyConfig(rollback_prob=0.0), decode=None)
    assert any(unfiltered[1].loss_mask) and not unfiltered[1].void_turn  # the filter off: trained, unmarked


def test_a_whitened_estimator_whitens_over_the_rows_that_train_only():
    """reinforce_plus_plus_baseline beside down-sampling and the void-turn filter: the group stage
    sees the kept rows (a void row among them), the whitening only the rows that train, by hand from
    their loss tokens; a dropped row stays 0."""
    rollouts, segments = group((1.0, (OK,)), (1.0, (ERROR, OK)), (1.0, (ERROR, ERROR, OK)), (0.0, (OK,), False),
                               (0.0, (ERROR, OK)), (0.0, ()))
    config = PurifyConfig(rollback_prob=0.0, down_sample="roc", down_sample_to=4, adv_estimator="reinforce_plus_plus_baseline",
                          void_turn_filter=True)
    rows, _ = render_iteration(rollouts, segments, config, decode=None)
    assert [(row.dropped, row.void_turn) for row in rows] == [(False, False), (False, False), (True, False),
                                                              (False, True), (False, False), (True, False)]
    scores = [0.5, 0.5, -0.5]  # kept rewards 1, 1, 0, 0 centred; the void row (the 4th kept) trains not
    tokens = [sum(rows[i].loss_mask[1:]) for i in (0, 1, 4)]
    total = sum(tokens)
    mean = sum(n * v for n, v in zip(tokens, scores, strict=True)) / (total + 1e-8)
    variance = sum(n * (v - mean) ** 2 for n, v in zip(tokens, scores, strict=True)) / (total + 1e-8) * total / (total - 1)
    expected = [(v - mean) / math.sqrt(variance + 1e-8) for v in scores]
    assert [rows[i].advantage for i in (0, 1, 4)] == pytest.approx(expected, rel=1e-9)
    assert rows[2].advantage == rows[5].advantage == 0.0


def test_untrained_rows_are_not_scored_and_the_others_equal_an_unfiltered_configs():
    rollouts, segments = group((1.0, (OK,)), (1.0, (ERROR, OK)), (1.0, (ERROR, ERROR, OK)), (0.0, (OK,)),
                               (0.0, (ERROR, OK)), (0.0, ()))
    scorer = FakeScorer()
    plain, roc = purify_iteration(rollouts, segments, [PurifyConfig(rollback_prob=0.0), ROC4], scorer, None, "v")
    assert len(scorer.calls) == 1  # one pass for both configs
    assert sorted(scorer.calls[0][0]) == sorted({row.token_ids for row in plain.rows})  # each raw row once
    alone = FakeScorer()
    (only,) = purify_iteration(rollouts, segments, [ROC4], alone, None, "v")
    assert sorted(alone.calls[0][0]) == sorted({row.token_ids for row in only.rows if not row.dropped})
    for a, b in zip(plain.rows, roc.rows, strict=True):
        assert a.token_ids == b.token_ids
        assert b.old_logprobs == (a.old_logprobs if not b.dropped else (0.0,) * len(a.token_ids))
    assert {row.scorer_version for row in roc.rows} == {"v"}  # a dropped row too was stored by this scorer's run


def test_a_default_purify_config_keeps_the_id_it_had_before_down_sampling_existed():
    assert PurifyConfig().config_id == "a8bf93c6f605"  # main's id before the selection fields
    assert PurifyConfig(gamma=0.3, edit="mask").config_id == "27ee3a776c64"
    assert len({ROC4.config_id, PurifyConfig(rollback_prob=0.0).config_id,
                PurifyConfig(rollback_prob=0.0, down_sample="uniform", down_sample_to=4).config_id,
                PurifyConfig(rollback_prob=0.0, void_turn_filter=True).config_id}) == 4


@pytest.mark.parametrize(("values", "message"), [
    ({"down_sample": "roc"}, "give both or neither"),
    ({"down_sample_to": 4}, "give both or neither"),
    ({"down_sample": "roc", "down_sample_to": 0}, "down_sample_to must be >= 1"),
    ({"down_sample": "roc", "down_sample_to": 3}, r"roc_min_negatives \+ roc_min_positives must be <= down_sample_to"),
    ({"down_sample": "top", "down_sample_to": 3}, "down_sample must be one of"),
])
def test_bad_down_sampling_is_refused_naming_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        PurifyConfig(**values)


def test_rollouts_are_candidates_in_sample_order_whatever_order_they_come_in():
    rollouts, segments = group(*[(1.0 if i % 3 == 0 else 0.0, (OK,)) for i in range(8)])
    shuffled = list(rollouts)
    random.Random(0).shuffle(shuffled)
    by_id = {r.rollout_id: kept for r, kept in zip(rollouts, select(rollouts, grouped(segments), ROC4,
                                                                   [False] * 8).kept, strict=True)}
    again = select(shuffled, grouped(segments), ROC4, [False] * 8)
    assert {r.rollout_id: kept for r, kept in zip(shuffled, again.kept, strict=True)} == by_id
