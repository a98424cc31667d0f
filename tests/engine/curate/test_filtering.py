"""The paper's pass-rate filter (cleaner/engine/curate/filtering.py): kept counts computed by hand for
every rate and both categories, --retain-code, attempts of 4 and 3, the draws against numpy's legacy
calls as the reference makes them, rows matched by uid, and categories by data source."""

from __future__ import annotations

import random
from fractions import Fraction as F

import numpy as np
import pytest

from cleaner.engine.curate.filtering import by_category, by_source, category_of, match_rows, select
from cleaner.engine.curate.ratios import parse_ratios
from cleaner.engine.curate.stats import PromptStats

CODE, MATH = "train-code-taco-easy", "math_dapo"
# prompts per rate i/8 (eight attempts), code and the rest
CODE_COUNTS = [3, 5, 4, 7, 2, 6, 1, 9, 4]
OTHER_COUNTS = [10, 7, 5, 3, 8, 6, 4, 2, 9]
RATIOS = "0.0:0.0,0.125:0.8,0.25:0.5,0.375:0.75,0.5:1,0.625:0.3,0.75:0.9,0.875:1.0,1.0:0.0"
# floor(count x ratio) by hand: 5 x 0.8 = 4; 7 x 0.8 = 5.6 -> 5; 4 x 0.5 = 2; 5 x 0.5 = 2.5 -> 2;
# 7 x 0.75 = 5.25 -> 5; 3 x 0.75 = 2.25 -> 2; 6 x 0.3 = 1.8 -> 1; 1 x 0.9 -> 0; 4 x 0.9 = 3.6 -> 3
KEPT_CODE = [0, 4, 2, 5, 2, 1, 0, 9, 0]
KEPT_OTHER = [0, 5, 2, 2, 8, 1, 3, 2, 0]
# --retain-code: code prompts whole at every rate but 0
KEPT_CODE_RETAINED = [0, 5, 4, 7, 2, 6, 1, 9, 4]


def eighths_dataset(seed: int = 0) -> list[PromptStats]:
    """One row per prompt, rates and categories interleaved in a shuffled order; uid = row."""
    prompts = [(i, source) for i in range(9) for source, counts in ((CODE, CODE_COUNTS), (MATH, OTHER_COUNTS))
               for _ in range(counts[i])]
    random.Random(seed).shuffle(prompts)
    return [PromptStats(str(row), source, i, 8, i / 8) for row, (i, source) in enumerate(prompts)]


def resolved(spec: str, rows: list[PromptStats]) -> dict:
    return parse_ratios(spec).resolve([s.attempts for s in rows], [s.rate for s in rows])


def test_every_rate_keeps_floor_of_count_times_ratio_per_category():
    rows = eighths_dataset()
    selection = select(rows, resolved(RATIOS, rows))
    assert [level.rate for level in selection.levels] == [F(i, 8) for i in range(9)]
    assert [(level.code.pool, level.other.pool) for level in selection.levels] == list(zip(CODE_COUNTS, OTHER_COUNTS, strict=True))
    assert [level.code.kept for level in selection.levels] == KEPT_CODE
    assert [level.other.kept for level in selection.levels] == KEPT_OTHER
    assert len(selection.kept_rows) == sum(KEPT_CODE) + sum(KEPT_OTHER) == 46
    kept = [rows[row] for row in selection.kept_rows]
    for i in range(9):  # the kept rows are those counts, rate by rate
        assert sum(s.successes == i and s.data_source == CODE for s in kept) == KEPT_CODE[i]
        assert sum(s.successes == i and s.data_source == MATH for s in kept) == KEPT_OTHER[i]


def test_retain_code_filters_code_only_at_rate_zero():
    rows = eighths_dataset()
    selection = select(rows, resolved(RATIOS, rows), retain_code=True)
    assert [level.code.kept for level in selection.levels] == KEPT_CODE_RETAINED
    assert [level.other.kept for level in selection.levels] == KEPT_OTHER
    assert [level.code.ratio for level in selection.levels] == [0.0] + [1.0] * 8


def test_the_short_form_keeps_the_same_rows():
    rows = eighths_dataset()
    short = "0,0.8,0.5,0.75,1,0.3,0.9,1,0"
    assert select(rows, resolved(short, rows)).kept_rows == select(rows, resolved(RATIOS, rows)).kept_rows


def test_a_rate_not_named_keeps_its_prompts_whole():
    rows = eighths_dataset()
    selection = select(rows, resolved("0.0:0.0", rows))
    assert [level.kept for level in selection.levels] == [0] + [c + o for c, o in zip(CODE_COUNTS, OTHER_COUNTS, strict=True)][1:]


def test_the_product_is_floored_in_floating_point_as_the_reference_does():
    # 100 x 0.57 = 56.99999999999999 in floating point: the reference's int() keeps 56
    rows = [PromptStats(str(row), MATH, 1, 2, 0.5) for row in range(100)]
    assert select(rows, {F(1, 2): 0.57}).levels[0].other.kept == 56


def test_attempts_of_four_and_three_keep_every_rate_that_occurs():
    """The reference visits i/8 only and drops 1/3 and 2/3; here each fraction is a rate."""
    # (successes, attempts, prompts): rates 0, 1/4, 1/2, 3/4, 1 and 0, 1/3, 2/3, 1
    plan = [(0, 4, 2), (1, 4, 3), (2, 4, 4), (3, 4, 1), (4, 4, 2), (0, 3, 3), (1, 3, 5), (2, 3, 2), (3, 3, 1)]
    rows = [PromptStats(f"{n}-{s}-{k}", MATH, s, n, s / n) for s, n, count in plan for k in range(count)]
    selection = select(rows, resolved("0.0:0.0,0.333:0.5,0.5:0.5,1.0:0.0", rows))
    by_rate = {level.rate: (level.prompts, level.kept) for level in selection.levels}
    # 1/3: 5 x 0.5 -> 2; 1/2: 4 x 0.5 -> 2; 1/4, 2/3, 3/4 not named: whole; 0 and 1: none
    assert by_rate == {F(0): (5, 0), F(1, 4): (3, 3), F(1, 3): (5, 2), F(1, 2): (4, 2), F(2, 3): (2, 2),
                       F(3, 4): (1, 1), F(1): (3, 0)}
    assert len(selection.kept_rows) == 10


def test_the_draws_are_the_references_numpy_calls():
    """np.random.seed(42 + int(sr * 1000)) then np.random.choice(indices, size, replace=False), the
    indices in dataset order (the reference's code, transcribed), code and the rest apart."""
    rows = eighths_dataset(seed=3)
    ratios = resolved(RATIOS, rows)
    expected = []
    for i, ratio in enumerate([0.0, 0.8, 0.5, 0.75, 1.0, 0.3, 0.9, 1.0, 0.0]):
        sr = i / 8.0
        for source, base in ((CODE, 42), (MATH, 43)):
            indices = [row for row, s in enumerate(rows) if s.successes == i and s.data_source == source]
            size = int(len(indices) * ratio)
            if size >= len(indices):
                expected += indices
            elif size > 0:
                np.random.seed(base + int(sr * 1000))
                expected += np.random.choice(indices, size=size, replace=False).tolist()
    selection = select(rows, ratios)
    assert selection.kept_rows == tuple(sorted(expected))
    seeds = {(level.rate, "code"): level.code.seed for level in selection.levels}
    assert seeds[(F(1, 8), "code")] == 167 and selection.levels[1].other.seed == 168
    assert seeds[(F(1, 2), "code")] is None  # kept whole: no draw


def test_another_seed_draws_other_prompts_of_the_same_counts():
    rows = eighths_dataset()
    first, other = select(rows, resolved(RATIOS, rows)), select(rows, resolved(RATIOS, rows), seed=7)
    assert [level.kept for level in first.levels] == [level.kept for level in other.levels]
    assert first.kept_rows != other.kept_rows
    assert other.levels[1].code.seed == 7 + 125


def test_kept_rows_are_in_the_datasets_order_and_rows_without_statistics_are_dropped():
    rows = eighths_dataset()
    with_gaps = [None if row % 5 == 0 else stats for row, stats in enumerate(rows)]
    selection = select(with_gaps, {})
    assert list(selection.kept_rows) == [row for row in range(len(rows)) if row % 5]


def test_statistics_without_attempts_are_no_statistics():
    rows = [PromptStats("0", MATH, 0, 0, 0.0), PromptStats("1", MATH, 1, 2, 0.5)]
    assert select(rows, {}).kept_rows == (1,)


# ---------------------------------------------------------------------------------------------
# Matching rows to statistics


def test_rows_match_their_uid_and_the_data_source_only_where_a_uid_repeats():
    stats = [PromptStats("0", "math", 1, 8, 0.1), PromptStats("1", "aime", 2, 8, 0.2),
             PromptStats("1", "code", 3, 8, 0.3), PromptStats("2", "math", 4, 8, 0.4)]
    uids = ["0", "1", "1", "2", "2", "9"]
    sources = ["other-name", "code", "gpqa", "math", "aime", "math"]
    matched = match_rows(uids, sources, stats)
    # uid 0: once in both, matched whatever its source (the reference's rule); uid 1: twice in the
    # statistics, so by source; uid 2: twice in the dataset, so by source; uid 9: none
    assert matched == [stats[0], stats[2], None, stats[3], None, None]


# ---------------------------------------------------------------------------------------------
# Categories


@pytest.mark.parametrize(("source", "category"), [
    ("math_dapo", "math"),  # 'math' is in it
    ("MBPP", "code"),  # exact, lower-cased
    ("train-code-taco-easy", "code"),  # 'taco' comes before 'code' in the table; both code
    ("test-code-leetcode-Medium", "code"),
    ("mega-science", "science"),
    ("train-math-deepscaler", "math"),
    ("livecodebench", "code"),
    ("gpqa_diamond", "science"),
    ("algebr", "math"),  # the source inside a name: 'algebr' is in 'algebra'
    ("ma", "code"),  # inside 'humaneval', which the table lists before 'math'
    ("toy", "other"),
    ("unknown", "other"),
    (None, "other"),
    ("code_of_physics", "code"),  # the first name of the table that matches: 'code' before 'physics'
])
def test_a_data_source_is_classified_as_the_reference_classifies_it(source, category):
    assert category_of(source) == category


def test_counts_per_source_and_category_are_before_and_after():
    rows = [PromptStats("0", "aime", 0, 1, 0.0), PromptStats("1", "aime", 1, 1, 1.0),
            PromptStats("2", "taco", 1, 1, 1.0), None]
    selection = select(rows, {F(0): 0.0})
    assert [(c.name, c.before, c.after) for c in by_source(selection)] == [("aime", 2, 1), ("taco", 1, 1)]
    assert [(c.name, c.before, c.after) for c in by_category(selection)] == [
        ("code", 1, 1), ("math", 2, 1), ("science", 0, 0), ("other", 0, 0)]
