"""Rewards: last \\boxed{} of the final turn, math-verify equivalence, multiple-choice letters."""

from __future__ import annotations

from cleaner.engine.grading.answers import RewardResult, compute_reward, last_boxed
from cleaner.engine.model.chat import format_call, tool_response_text


def test_boxed_integer_right_wrong_and_missing():
    assert compute_reward("So the answer is \\boxed{42}.<|im_end|>", "42", "toy") == RewardResult(1.0, True, "42")
    assert compute_reward("The result is 43.\n\\boxed{43}<|im_end|>", "42", "toy") == RewardResult(0.0, False, "43")
    assert compute_reward("The result is 42.<|im_end|>", "42", "toy") == RewardResult(0.0, False, None)


def test_the_last_boxed_answer_counts():
    assert compute_reward("\\boxed{41} no wait \\boxed{42}", "42", "toy").correct
    assert not compute_reward("\\boxed{42} no wait \\boxed{41}", "42", "toy").correct


def test_math_verify_equivalence():
    assert compute_reward("\\boxed{1/2}", "0.5", "math").correct
    assert compute_reward("\\boxed{\\frac{1}{2}}", "0.5", "math").correct
    assert compute_reward("\\boxed{0.5}", "\\frac{1}{2}", "math").correct
    assert not compute_reward("\\boxed{\\frac{1}{3}}", "0.5", "math").correct


def test_only_the_final_turn_is_read_not_tool_output():
    call = "I compute.\n" + format_call("print('\\\\boxed{42}')")
    tool = tool_response_text("Tool call success\nstdout: \\boxed{42}\n")
    assert compute_reward(call + tool + "I give up.<|im_end|>", "42", "toy") == RewardResult(0.0, False, None)
    assert compute_reward(call + tool + "\\boxed{42}<|im_end|>", "42", "toy").correct


def test_nested_braces_in_boxed():
    assert last_boxed("x \\boxed{\\frac{3}{4}} y") == "\\frac{3}{4}"
    assert last_boxed("\\boxed{12") is None


def test_gpqa_letter_boxed_or_answer_line():
    assert compute_reward("Thinking...\nAnswer: C", "C", "gpqa_diamond") == RewardResult(1.0, True, "C")
    assert compute_reward("\\boxed{(b)}", "B", "gpqa") == RewardResult(1.0, True, "B")
    assert compute_reward("\\boxed{D}", "(B)", "GPQA") == RewardResult(0.0, False, "D")
    assert compute_reward("I am not sure.", "B", "gpqa") == RewardResult(0.0, False, None)
