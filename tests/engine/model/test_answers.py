"""What an engine's answer, and a warehouse's stored values, must be to be a policy's
(cleaner/engine/model/answers.py): read back over stored segments and purified rows."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from cleaner.engine.model.answers import (
    LOGPROB_SLACK,
    BadAnswer,
    checked_generation,
    checked_score_rows,
    checked_scores,
    generation_fault,
    refusal,
    row_value_faults,
    stored_value_faults,
)
from cleaner.engine.model.base import LENGTH, STOP, BackendError, Generation
from tests.factories import make_segments, train_row

# ---------------------------------------------------------------------------- an engine's answer


def test_a_generation_at_the_edges_of_what_a_policy_gives_is_its_own():
    """The first and last ids of the vocabulary, exactly the tokens asked for, a log-prob of 0 and
    one that exceeds 0 by exactly the rounding slack are all a policy's; without a vocabulary size
    the ids are not checked."""
    edges = Generation(token_ids=(0, 63, 5), logprobs=(0.0, LOGPROB_SLACK, -30.0), finish_reason=LENGTH)
    assert generation_fault(edges, max_new_tokens=3, vocab_size=64, reported_length=3) is None
    assert checked_generation(edges, 3, 64, reported_length=3) is edges
    assert checked_generation(edges, 3, 64) is edges  # an engine that reports no length
    unknown = Generation(token_ids=(10**6,), logprobs=(-1.0,), finish_reason=STOP)
    assert generation_fault(unknown, max_new_tokens=1, vocab_size=None) is None


@pytest.mark.parametrize(("generation", "max_new_tokens", "reported", "why"), [
    (Generation((4, 5), (-0.5,), STOP), 8, None, "2 token ids but 1 log-probs"),
    (Generation((4, 5), (-0.5, -0.5), STOP), 8, 3, "the engine reports 3 generated tokens but sent 2"),
    (Generation((), (), LENGTH), 8, None, "no token generated (finish reason 'length'); a generation ends on a token"),
    (Generation((4, 5, 6), (-0.5,) * 3, LENGTH), 2, None, "3 tokens generated where at most 2 were asked for"),
    (Generation((4, 64), (-0.5, -0.5), STOP), 8, None, "token id 64 at position 1 is outside the vocabulary [0, 64)"),
    (Generation((4, 5), (-0.5, 2 * LOGPROB_SLACK), STOP), 8, None,
     "log-prob 0.002 at position 1 is not a finite number <= 0"),  # a probability above 1, not rounding
    (Generation((4, 5), (-math.inf, -0.5), STOP), 8, None, "log-prob -inf at position 0 is not a finite number <= 0"),
])
def test_a_generation_no_policy_gives_is_named_and_is_an_infrastructure_fault(generation, max_new_tokens, reported,
                                                                               why):
    assert generation_fault(generation, max_new_tokens, 64, reported) == why
    message = "the engine's generation is not a policy's: " + why
    with pytest.raises(BadAnswer, match=f"^{re.escape(message)}$") as raised:
        checked_generation(generation, max_new_tokens, 64, reported)
    assert isinstance(raised.value, BackendError)  # collected again on --resume, never trained on


def test_scores_are_one_log_prob_per_token_asked_for():
    assert checked_scores((-0.5, 0.0), 2) == [-0.5, 0.0]
    with pytest.raises(BadAnswer, match="^the engine scored 1 tokens where 2 were asked for$"):
        checked_scores((-0.5,), 2)
    with pytest.raises(BadAnswer, match=re.escape(
            "the engine's scores are not log-probs: log-prob nan at position 1 is not a finite number <= 0")):
        checked_scores((-0.5, math.nan), 2)
    # row i holds the log-probs of sequences[i][starts[i]:]: 1 token, then 3 - 1 = 2
    rows = checked_score_rows(((-1.0,), (-0.5, -0.25)), [[1, 2], [1, 2, 3]], [1, 1])
    assert rows == [[-1.0], [-0.5, -0.25]]
    with pytest.raises(BadAnswer, match="^the engine scored 2 tokens where 1 were asked for$"):
        checked_score_rows(((-1.0,), (-0.5, -0.25)), [[1, 2], [1, 2, 3]], [1, 2])
    with pytest.raises(BadAnswer, match="^the engine answered 1 score rows to 2 asked$"):
        checked_score_rows(((-1.0,),), [[1, 2], [1, 2, 3]], [1, 1])
    with pytest.raises(ValueError, match="zip"):  # a caller's starts that miss a row: refused, never cut short
        checked_score_rows(((-1.0,), (-0.5, -0.25)), [[1, 2], [1, 2, 3]], [1])


def test_a_fault_names_the_first_value_outside_the_rules_not_an_edge_before_it():
    """The first offending id or log-prob is named, past values on the rules' edges (id 0, a log-prob
    of exactly the slack) that a stricter bound would name instead."""
    ids = Generation((0, 5, 99), (-0.5,) * 3, STOP)
    assert generation_fault(ids, 8, 10) == "token id 99 at position 2 is outside the vocabulary [0, 10)"
    logprobs = Generation((4, 5), (LOGPROB_SLACK, math.nan), STOP)
    assert generation_fault(logprobs, 8, 10) == "log-prob nan at position 1 is not a finite number <= 0"


# ---------------------------------------------------------------------------- stored values


def test_a_stored_id_past_the_vocabulary_is_refused_in_any_segment_kind():
    """The ids of a prompt or a tool response are what a forward indexes too (purify's IndexError):
    one at or past the vocabulary is refused wherever it is, not only in an assistant turn."""
    segments = make_segments("r0")  # ids 1..12, assistant log-probs -0.5
    assert stored_value_faults(segments, vocab_size=13) == {}
    tool = [dataclasses.replace(s, token_ids=(7, 13)) if s.seq == 2 else s for s in segments]
    assert stored_value_faults(tool, vocab_size=13) == {
        "r0": "seq 2: token id 13 at position 1 is outside the vocabulary [0, 13)"}
    prompt = [dataclasses.replace(s, token_ids=(1, 2, -1)) if s.seq == 0 else s for s in segments]
    assert stored_value_faults(prompt, vocab_size=13) == {
        "r0": "seq 0: token id -1 at position 2 is outside the vocabulary [0, 13)"}


def test_each_rollout_is_named_once_by_its_first_faulty_segment():
    segments = [dataclasses.replace(s, token_ids=(13,)) if s.seq in (0, 2) else s for s in make_segments("r0")]
    clean = make_segments("r1")
    assert stored_value_faults([*segments, *clean], vocab_size=13) == {
        "r0": "seq 0: token id 13 at position 0 is outside the vocabulary [0, 13)"}


def test_a_stored_assistant_turn_needs_its_log_probs_and_a_token():
    """An assistant turn without behaviour log-probs, with one above 0, or without a token is no
    policy's; a turn's bad id is named before its log-probs, and a rollout's first faulty segment."""
    segments = make_segments("r0")  # seq 1, 3 and 5 are the assistant turns

    def changed(seq, **changes):
        return [dataclasses.replace(s, **changes) if s.seq == seq else s for s in segments]

    assert stored_value_faults(changed(1, logprobs=None), 13) == {
        "r0": "seq 1: its behaviour log-probs do not match its tokens"}
    assert stored_value_faults(changed(3, logprobs=(-0.5, 0.5, -0.5)), 13) == {
        "r0": "seq 3: log-prob 0.5 at position 1 is not a finite number <= 0"}
    assert stored_value_faults(changed(5, token_ids=(), logprobs=()), 13) == {
        "r0": "seq 5: an assistant turn without a token"}
    assert stored_value_faults(changed(1, token_ids=(13, 5, 6)), 13) == {
        "r0": "seq 1: token id 13 at position 0 is outside the vocabulary [0, 13)"}
    both = [dataclasses.replace(s, logprobs=(0.5,) * len(s.token_ids)) if s.seq in (3, 5) else s for s in segments]
    assert stored_value_faults(both, 13) == {"r0": "seq 3: log-prob 0.5 at position 0 is not a finite number <= 0"}


def test_a_refusal_names_five_rollouts_and_counts_the_rest():
    assert refusal({}, "values") is None
    assert refusal({"r1": "seq 1: why"}, "tokens or log-probs") == (
        "1 rollout(s) hold tokens or log-probs no policy produced: r1 (seq 1: why)")
    five = {f"r{i}": f"f{i}" for i in range(5)}
    assert refusal(five, "values") == "5 rollout(s) hold values no policy produced: r0 (f0); r1 (f1); r2 (f2); r3 (f3); r4 (f4)"
    seven = {f"r{i}": f"f{i}" for i in range(7)}
    assert refusal(seven, "values") == (
        "7 rollout(s) hold values no policy produced: r0 (f0); r1 (f1); r2 (f2); r3 (f3); r4 (f4) and 2 more")


def _row(**changes):
    """Prompt [1, 2], response [3, 4, 5] trained, advantage 0.5, log-probs 0."""
    return dataclasses.replace(train_row("r1", "g", [1, 2, 3, 4, 5], 2, reward=1.0, advantage=0.5), **changes)


def test_a_stored_rows_ids_are_read_against_the_vocabulary():
    assert row_value_faults([_row(token_ids=(1, 2, 3, 6, 5))], vocab_size=6) == {
        "r1": "token id 6 at position 3 is outside the vocabulary [0, 6)"}
    assert row_value_faults([_row(token_ids=(1, 2, 3, 6, 5))], vocab_size=None) == {}  # no model to read it against


def test_a_stored_row_with_a_token_advantage_not_finite_is_refused():
    assert row_value_faults([_row(token_advantages=(0.0, 0.0, 0.5, 0.25, 0.5))], vocab_size=6) == {}
    faults = row_value_faults([_row(token_advantages=(0.0, 0.0, 0.5, math.nan, 0.5))], vocab_size=6)
    assert faults == {"r1": "a reward or advantage that is not finite (advantage 0.5, reward 1.0)"}
    assert row_value_faults([_row(reward=math.inf)], vocab_size=6) == {
        "r1": "a reward or advantage that is not finite (advantage 0.5, reward inf)"}


@pytest.mark.parametrize("name", ["behavior_logprobs", "old_logprobs"])
def test_a_rows_log_probs_are_read_on_its_trained_tokens_only(name):
    """A value at an untrained position (the prompt's 0, here NaN) is never trained: not refused.
    The same value at a trained position is; an infrastructure fault's row is never read."""
    untrained = _row(**{name: (math.nan, 0.0, -0.5, -0.25, -1.0)})
    assert row_value_faults([untrained], vocab_size=6) == {}
    trained = _row(**{name: (0.0, 0.0, -0.5, 0.5, -1.0)})
    label = "behaviour" if name == "behavior_logprobs" else "old"
    assert row_value_faults([trained], vocab_size=6) == {
        "r1": f"{label} log-prob 0.5 at position 1 is not a finite number <= 0 among the trained tokens"}
    assert row_value_faults([dataclasses.replace(trained, infra_fault=True)], vocab_size=6) == {}
