"""The LiveCodeBench grader on small stdin/stdout problems, through the real sandbox."""

from __future__ import annotations

import json

import pytest

from cleaner.engine.collect.tasks import Task
from cleaner.engine.grading.answers import RewardResult
from cleaner.engine.grading.programs import (
    Grader,
    grading_sandbox_config,
    last_python_block,
    parse_tests,
    same_output,
)
from cleaner.engine.model.chat import format_call, tool_response_text
from cleaner.sandbox import ExecStatus, SandboxConfig, make_sandbox

# "Print the sum of the two integers on the line", three tests.
TESTS = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]})
SOURCE = "LiveCodeBench_v6"


def answer(code: str) -> str:
    return f"Here is my program.\n```python\n{code}\n```<|im_end|>"


@pytest.fixture(scope="module")
def grader():
    task = Task("lcb-0", ({"role": "user", "content": "Add."},), TESTS, SOURCE)
    config = grading_sandbox_config(SandboxConfig(workers=2), 1.0, [task])
    with make_sandbox(config) as sandbox:
        yield Grader(sandbox)


def test_a_right_program_passes(grader):
    code = "a, b = map(int, input().split())\nprint(a + b)"
    assert grader(answer(code), TESTS, SOURCE) == RewardResult(1.0, True, code + "\n")


def test_trailing_whitespace_does_not_matter(grader):
    code = "a, b = map(int, input().split())\nprint(a + b, end='  \\n\\n')"
    assert grader(answer(code), TESTS, SOURCE).correct


def test_a_wrong_program_fails(grader):
    code = "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)"  # right on 2 of 3 tests
    assert grader(answer(code), TESTS, SOURCE) == RewardResult(0.0, False, code + "\n")


def test_a_program_that_times_out_fails(grader):
    result = grader(answer("while True:\n    pass"), TESTS, SOURCE)
    assert not result.correct and result.reward == 0.0
    assert grader.sandbox.run("while True:\n    pass", "1 2\n").status == ExecStatus.TIMEOUT  # the 1 s test limit


def test_a_program_that_crashes_fails(grader):
    assert not grader(answer("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)"),
                      TESTS, SOURCE).correct
    assert not grader(answer("print(1 / 0)"), TESTS, SOURCE).correct


def test_no_python_block_is_wrong_without_running_anything():
    assert Grader(None)("The answer is 3.<|im_end|>", TESTS, SOURCE) == RewardResult(0.0, False, None)


def test_only_the_final_turn_is_graded(grader):
    code = "a, b = map(int, input().split())\nprint(a + b)"
    call = "Let me test.\n" + format_call(code) + tool_response_text("Tool call success\nstdout: 3\n")
    assert not grader(call + "I am done.<|im_end|>", TESTS, SOURCE).correct  # the block was in the call only


def test_other_sources_go_to_the_math_and_letter_rewards():
    assert Grader(None)("\\boxed{204}<|im_end|>", "204", "AIME2024").correct
    assert Grader(None)("\\boxed{C}<|im_end|>", "C", "gpqa_diamond").correct


def test_parts():
    assert last_python_block("```python\nx = 1\n```\ntext\n```python\ny = 2\n```") == "y = 2\n"
    assert last_python_block("```py\nx = 1\n```") is None
    assert same_output("1 \n2\n\n", "1\n2") and not same_output("1\n2", "1 2")
    assert parse_tests(TESTS).outputs == ("3\n", "7\n", "0\n")
    with pytest.raises(ValueError, match="as the ground truth"):
        parse_tests("42")


def test_grading_sandbox_keeps_the_longest_expected_output():
    long = json.dumps({"inputs": [""], "outputs": ["x" * 10_000]})
    config = grading_sandbox_config(SandboxConfig(), 6.0, [Task("t", (), long, SOURCE), Task("m", (), "1", "math")])
    assert config.timeout_s == 6.0 and config.cpu_time_s == 7 and config.max_output_chars == 11_024
