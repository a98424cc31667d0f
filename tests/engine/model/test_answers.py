"""What an engine's answer, and a warehouse's stored values, must be to be a policy's
(cleaner/engine/model/answers.py): read back over stored segments and purified rows."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cleaner.engine.model.answers import row_value_faults, stored_value_faults
from tests.factories import make_segments, train_row


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


def _row(**changes):
    """Prompt [1, 2], response [3, 4, 5] trained, advantage 0.5, log-probs 0."""
    return dataclasses.replace(train_row("r1", "g", [1, 2, 3, 4, 5], 2, reward=1.0, advantage=0.5), **changes)


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
