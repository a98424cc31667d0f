"""--success-rate-ratios (cleaner/engine/curate/ratios.py): the paper's two syntaxes, what a named
rate means for statistics of any attempt count, and every spec that must be refused."""

from __future__ import annotations

from fractions import Fraction as F

import pytest

from cleaner.engine.curate.ratios import RatioError, parse_ratios

EIGHT = [8]  # attempts per prompt of the paper's statistics
EIGHTHS = [F(i, 8) for i in range(9)]
PAPER = "0.0:0.0,0.125:0.8,0.25:0.9,0.375:1.0,0.5:1,0.625:1,0.75:1,0.875:1,1.0:0.0"  # data_filter.sh's


def test_the_two_syntaxes_say_the_same():
    pairs = parse_ratios(PAPER).resolve(EIGHT, EIGHTHS)
    short = parse_ratios("0,0.8,0.9,1,1,1,1,1,0").resolve(EIGHT, EIGHTHS)
    assert pairs == short == {F(0): 0.0, F(1, 8): 0.8, F(1, 4): 0.9, F(3, 8): 1.0, F(1, 2): 1.0, F(5, 8): 1.0,
                              F(3, 4): 1.0, F(7, 8): 1.0, F(1): 0.0}


def test_a_pair_names_a_rate_within_the_papers_tolerance_of_it():
    # attempts of 3: 0.333 and 0.667 are 1/3 and 2/3; 0.6666 too (0.00007 away)
    assert parse_ratios("0.333:0.5,0.6666:0.25").resolve([3], [F(1, 3)]) == {F(1, 3): 0.5, F(2, 3): 0.25}
    # mixed attempt counts: 0.25 is 1/4 of four attempts, 0.5 is 2/4 and 4/8 alike (one fraction)
    assert parse_ratios("0.25:0.1,0.5:0.2").resolve([4, 8], [F(1, 4)]) == {F(1, 4): 0.1, F(1, 2): 0.2}
    # a rate no prompt has may still be named: 3/8 with eight attempts
    assert parse_ratios("0.375:0").resolve(EIGHT, [F(0)]) == {F(3, 8): 0.0}


def test_no_spec_keeps_every_rate_whole():
    assert parse_ratios(None) is None


def test_the_nine_values_are_eighths_and_hold_for_four_attempts():
    assert parse_ratios("1,1,1,1,1,1,1,1,0.5").resolve([4], [F(1, 4), F(3, 4)])[F(1)] == 0.5


@pytest.mark.parametrize(("spec", "message"), [
    ("", "expected RATE:RATIO pairs or nine ratios"),
    ("0.0:0.5,", "without an empty item"),
    ("0.0:0.5,0.3", "'0.3' is not RATE:RATIO"),
    ("0.0:0.5:1", "'0.0:0.5:1' is not RATE:RATIO"),
    ("0.0:half", "ratio 'half' is not a number"),
    ("zero:0.5", "success rate 'zero' is not a number"),
    ("0.0:nan", "ratio 'nan' is not a number"),
    ("0.5,0.5", "the short form takes exactly nine ratios (for the rates 0/8 .. 8/8), got 2"),
    ("0.0:1.5", "ratio 1.5 is outside [0, 1]"),
    ("0.0:-0.1", "ratio -0.1 is outside [0, 1]"),
    ("1.125:0.5", "success rate 1.125 is outside [0, 1]"),
    ("1,1,1,1,1,1,1,1,2", "ratio 2 is outside [0, 1]"),
    ("0.5:1,0.50:0", "success rate 0.5 is named twice ('0.5:1' and '0.50:0')"),
])
def test_a_spec_that_does_not_parse_is_refused(spec, message):
    with pytest.raises(RatioError, match="^--success-rate-ratios ") as caught:
        parse_ratios(spec)
    assert message in str(caught.value)


@pytest.mark.parametrize(("spec", "attempts", "rates", "message"), [
    ("0.3:0.5", EIGHT, EIGHTHS, "0.3 is not a success rate of these statistics (within 0.001 of j/n for their "
                                "attempts per prompt n = 8)"),
    ("0.125:1,0.1251:0", EIGHT, EIGHTHS, "rates 0.125 and 0.1251 both name success rate 1/8"),
    ("0.5:1", [1000, 999], [F(1, 2)], "0.5 is within 0.001 of the success rates 499/999 and 1/2"),
    ("1,1,1,1,1,1,1,1,1", [3], [F(1, 3)], "the nine-value form names the rates 0/8 .. 8/8, but the statistics hold "
                                          "rate 1/3"),
])
def test_a_spec_the_statistics_do_not_fit_is_refused(spec, attempts, rates, message):
    with pytest.raises(RatioError) as caught:
        parse_ratios(spec).resolve(attempts, rates)
    assert message in str(caught.value)
