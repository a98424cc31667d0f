"""The printed tables: one formatter per kind of number, the purify comparison (counters per config,
varying parameters only, token counts), the premise, the evaluations and the iterations."""

from __future__ import annotations

import dataclasses
import math

import pytest
from rich.console import Console

from cleaner.config import PurifyConfig
from cleaner.engine.purify.pipeline import PurifyResult, PurifyStats
from cleaner.engine.saar.premise import ClassStats, FailedCallCredit, PremiseStats
from cleaner.records import IterationRow, PurifiedRow
from cleaner.report.tables import (
    eval_table,
    iteration_table,
    number,
    premise_table,
    rate,
    seconds,
    setting,
    signed,
    stats_frame,
    stats_table,
)
from tests.factories import make_eval_run

# ---------------------------------------------------------------------------------------------
# The formatters


@pytest.mark.parametrize(("formatter", "value", "text"), [
    (rate, 2 / 3, "66.7%"), (rate, 0.0, "0.0%"), (rate, 1.0, "100.0%"), (rate, 0.0005, "0.1%"),
    (number, 1.3125, "1.312"), (number, 0.33333, "0.333"), (number, 12.0, "12.000"),
    (signed, 0.3481, "+0.348"), (signed, -0.7071, "-0.707"), (signed, 0.0, "+0.000"),
    (seconds, 19.24, "19.2"), (seconds, 0.04, "0.0"),
    (setting, 0.699999988079071, "0.7"), (setting, 1e-4, "0.0001"), (setting, 3, "3"), (setting, "code", "code"),
    (setting, True, "True"),
])
def test_each_kind_of_number_has_one_format(formatter, value, text):
    assert formatter(value) == text


@pytest.mark.parametrize("formatter", [rate, number, signed, seconds, setting])
def test_a_missing_value_is_a_dash_whatever_its_kind(formatter):
    assert formatter(None) == formatter(math.nan) == "-"


def _cells(table, first: str, index: int = 0) -> list[str]:
    """The cells of the `index`-th printed row whose first cell is `first`."""
    console = Console(width=250, record=True)
    console.print(table)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.startswith("│")]
    return [row for row in rows if row[0] == first][index]


# ---------------------------------------------------------------------------------------------
# Each table through them


def _row(config_id: str, loss_mask, old, behaviour) -> PurifiedRow:
    n = len(loss_mask)
    return PurifiedRow(config_id=config_id, iteration=0, rollout_id="r", group_id="g",
                       token_ids=tuple(range(n)), prompt_len=1, loss_mask=tuple(loss_mask),
                       behavior_logprobs=tuple(behaviour), old_logprobs=tuple(old), reward=1.0,
                       advantage=0.0, rolled_back=True, n_shallow=1, n_deep=0, n_unrecovered=0,
                       tokens_removed=3, scorer_version="t")


def _result(gamma: float) -> PurifyResult:
    config = PurifyConfig(gamma=gamma)
    rows = [
        # 3 trained tokens, one of them rewritten (|-1.0 - -0.5| > 1e-3); the masked one never counts
        _row(config.config_id, [0, 1, 1, 1], [0.0, -0.5, -1.0, -0.2], [-9.0, -0.5, -0.5, -0.2]),
        _row(config.config_id, [0, 1], [0.0, -0.3], [0.0, -0.3002]),  # within tolerance
    ]
    stats = PurifyStats(config_id=config.config_id, n_rollouts=2, n_rolled_back=2, n_shallow=1,
                        n_deep=int(gamma > 1), n_unrecovered=0, tokens_removed=6,
                        errors_by_type=(("NameError", 3), ("timeout", 1)))
    return PurifyResult(config, rows, stats)


def test_frame_counts_trained_and_rewritten_tokens():
    frame = stats_frame([_result(0.5)])
    assert frame.select("trained", "rewritten", "rolled", "removed").row(0) == (4, 1, 2, 6)


def test_table_shows_only_varying_parameters():
    results = [_result(0.5), _result(1.1)]
    console = Console(width=200, record=True)
    console.print(stats_table(results))
    text = console.export_text()
    assert "purify (2 rollouts, p 1, sim code, when always)" in text
    line = next(line for line in text.splitlines() if results[1].config.config_id[:8] in line)
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == [results[1].config.config_id[:8], "1.1", "2", "1", "1", "0", "0", "6", "4", "1"]
    assert "failed calls in the input: NameError 3, timeout 1" in text


def test_premise_rates_advantages_and_an_empty_class():
    premise = PremiseStats(ClassStats(12, 0.75, 0.3481), ClassStats(4, 0.5, -0.25), ClassStats(0, None, None),
                           FailedCallCredit(40, -0.6754, 0.3275))
    table = premise_table(premise)
    assert _cells(table, "clean") == ["clean", "12", "75.0%", "+0.348"]
    assert _cells(table, "unrecovered") == ["unrecovered", "0", "-", "-"]
    assert _cells(table, "failed-call tokens") == ["failed-call tokens", "40", "32.8% in +adv", "-0.675"]
    assert table.caption.startswith("recovered / clean accuracy 0.667: ")


def test_eval_rows_print_rates_as_percentages_and_the_latency_ratio():
    raw = make_eval_run("e-raw", saar=False, seconds=2.0)
    saar = make_eval_run("e-saar", saar=True, seconds=2.5, first_call_error_rate=0.3125,
                         pass_at_k=((1, 0.25), (2, 0.5)))  # no pass@4: the column shows it missing
    table = eval_table([raw, saar])
    # model, dataset, saar, problems, avg@4, pass@1, pass@2, pass@4, maj@4, calls/traj, fail/traj,
    # 1st-call err (NaN: no calls), seconds, latency x (2.5 s over 2.0 s for 8 rollouts each)
    assert _cells(table, "m", 0) == ["m", "aime24", "off", "2", "25.0%", "25.0%", "50.0%", "75.0%", "50.0%",
                                     "1.500", "0.125", "-", "2.0", "-"]
    assert _cells(table, "m", 1) == ["m", "aime24", "on", "2", "25.0%", "25.0%", "50.0%", "-", "50.0%",
                                     "1.500", "0.125", "31.2%", "2.5", "1.250"]


def test_iterations_print_rates_as_percentages_and_a_missing_error_rate_as_a_dash():
    row = IterationRow(iteration=0, policy_in="p0", policy_out="p1", collect_config_json="{}",
                       purify_config_json="{}", train_config_json="{}", collect_s=12.34, purify_s=0.56,
                       train_s=7.0, accuracy=0.6875, first_attempt_error_rate=0.25, failures_per_trajectory=0.4375,
                       n_shallow=3, n_deep=1)
    later = dataclasses.replace(row, iteration=1, first_attempt_error_rate=math.nan)  # no call was made
    table = iteration_table([row, later])
    assert _cells(table, "0") == ["0", "68.8%", "25.0%", "0.438", "3", "1", "12.3", "0.6", "7.0"]
    assert _cells(table, "1")[:3] == ["1", "68.8%", "-"]
