"""summarize() on three hand-built rollouts whose numbers are counted by hand below."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from cleaner.engine.collect.summary import summarize
from cleaner.records import Rollout, Segment
from cleaner.report.tables import summary_table


def rollout(rollout_id: str, correct: bool, finish_reason: str) -> Rollout:
    return Rollout(rollout_id, 0, "g", "p", 0, "v", "toy", "42", "42" if correct else None,
                   float(correct), correct, finish_reason, 0.1, "purified", "c", 0, 0, 0)


def trajectory(rollout_id: str, spec: list[tuple]) -> list[Segment]:
    """spec rows: ("a", step, attempt, call) with call in {None, "code", "bad"}, or
    ("t", step, attempt, status, error_type)."""
    segments = [Segment(rollout_id, 0, 0, "prompt", None, None, (1,), None, "q")]
    for seq, row in enumerate(spec, start=1):
        if row[0] == "a":
            _, step, attempt, call = row
            segments.append(Segment(rollout_id, 0, seq, "assistant", step, attempt, (2, 3), (-0.1, -0.2),
                                    "x", call_start=None if call is None else 1,
                                    tool_code="print(1)" if call == "code" else None))
        else:
            _, step, attempt, status, error_type = row
            segments.append(Segment(rollout_id, 0, seq, "tool", step, attempt, (4,), None, "r",
                                    tool_status=status, error_type=error_type, exec_ms=1.0))
    return segments


ROLLOUTS = [rollout("r1", True, "answer"), rollout("r2", False, "max_turns"),
            rollout("r3", True, "answer")]
SEGMENTS = (
    # r1: a NameError fixed at the retry (a recovered chain), then the answer
    trajectory("r1", [("a", 0, 0, "code"), ("t", 0, 0, "error", "NameError"),
                      ("a", 0, 1, "code"), ("t", 0, 1, "ok", None), ("a", 1, 0, None)])
    # r2: a malformed call then a NameError (K = 1, unrecovered); a timeout; a retry that gives up
    + trajectory("r2", [("a", 0, 0, "bad"), ("t", 0, 0, "format_error", "FormatError"),
                        ("a", 0, 1, "code"), ("t", 0, 1, "error", "NameError"),
                        ("a", 1, 0, "code"), ("t", 1, 0, "timeout", None), ("a", 1, 1, None)])
    # r3: one good call, then the answer
    + trajectory("r3", [("a", 0, 0, "code"), ("t", 0, 0, "ok", None), ("a", 1, 0, None)])
)


def test_summary_by_hand():
    s = summarize(ROLLOUTS, SEGMENTS)
    assert (s.rollouts, s.tool_calls, s.failed_calls, s.retries) == (3, 6, 4, 3)
    assert s.accuracy == pytest.approx(2 / 3) and s.mean_reward == pytest.approx(2 / 3)
    assert s.failed_calls_per_rollout == pytest.approx(4 / 3)
    assert s.well_formed_call_rate == pytest.approx(5 / 6)  # r2's first call did not parse
    assert s.first_attempt_error_rate == pytest.approx(3 / 4)  # r1 s0, r2 s0, r2 s1 of 4
    assert s.failures_by_error_type == (("NameError", 2), ("FormatError", 1), ("timeout", 1))
    assert (s.chains_with_failure, s.recovered_chains) == (3, 1)
    assert s.recovery_rate == pytest.approx(1 / 3)
    assert s.finish_reasons == (("answer", 2), ("max_turns", 1))


def test_empty_summary_is_nan_not_zero():
    s = summarize([], [])
    assert s.rollouts == 0 and s.tool_calls == 0 and s.failures_by_error_type == ()
    assert all(math.isnan(x) for x in (s.accuracy, s.recovery_rate, s.first_attempt_error_rate))


def render_text(table) -> str:
    console = Console(width=100, record=True)
    console.print(table)
    return console.export_text()


def test_summary_table_lists_every_number():
    text = render_text(summary_table(summarize(ROLLOUTS, SEGMENTS)))
    for metric, value in [("accuracy", "66.7%"), ("well-formed calls", "83.3%"),
                          ("first-attempt error rate", "75.0%"), ("recovery rate", "33.3%"),
                          ("failures: NameError", "2"), ("finish: max_turns", "1")]:
        line = next(line for line in text.splitlines() if metric in line)
        assert line.split()[-2] == value, line
    assert "recovery rate" in render_text(summary_table(summarize([], [])))
