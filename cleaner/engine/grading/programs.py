"""Grading answers, including programs run against stored stdin/stdout tests (docs/architecture.md §12).

Design decisions:
- A data source containing "code" (LiveCodeBench_v6 among them) is graded by its tests, the
  reference's rule; every other source by `compute_reward` (math-verify on the last `\\boxed{}`,
  or the boxed letter for GPQA). `Grader` has the agent loop's reward signature, so evaluation
  hands it to `collect` unchanged.
- The program is the last ```python block of the final assistant turn (the reference's pattern
  `'```python\\n(.*?)```'`). It passes iff every test passes: it exits cleanly within the per-test
  time limit and its stdout equals the expected output once each line's trailing whitespace and
  the trailing blank lines are stripped. The reward is 1 or 0 (the reference's `acc`; its
  fractional score is a training signal, not a metric the paper reports).
- Tests run in their own sandbox (`grading_sandbox_config`): the per-test limit is not the tool's,
  and stdout must not be truncated below the longest expected output, or a right program would
  fail. Tests of one program run `workers` at a time and stop after the first batch with a
  failure: the verdict is the same and a wrong program costs one batch.
- A test the sandbox itself could not run (infra_error) counts as failed and is logged: grading
  must finish, and the log says which verdicts an infrastructure fault decided.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from cleaner.engine.grading.answers import RewardResult, choice_letter, compute_reward, final_text
from cleaner.errors import JobError
from cleaner.sandbox import ExecStatus, SandboxConfig, make_sandbox

logger = logging.getLogger(__name__)

CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
OUTPUT_MARGIN_CHARS = 1024  # stdout kept beyond the longest expected output


@dataclass(frozen=True)
class StdioTests:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class GradedTask(Protocol):
    """What grading reads of a task (collect's `Task` has it): grading imports no stage."""

    @property
    def data_source(self) -> str: ...

    @property
    def ground_truth(self) -> str: ...


def is_code_source(data_source: str) -> bool:
    return "code" in data_source.lower()


def parse_tests(ground_truth: str) -> StdioTests:
    """The tests a code task stores as its ground truth (datasets.py); ValueError if malformed."""
    try:
        data = json.loads(ground_truth)
        inputs, outputs = data["inputs"], data["outputs"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f'expected {{"inputs": [...], "outputs": [...]}} as the ground truth, got '
                         f"{ground_truth!r:.120}") from error
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} test inputs for {len(outputs)} outputs")
    return StdioTests(tuple(inputs), tuple(outputs))


def last_python_block(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def same_output(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(actual) == lines(expected)


def grading_sandbox_config(tool: SandboxConfig, test_timeout_s: float, tasks: Sequence[GradedTask]) -> SandboxConfig:
    """The tool's sandbox settings with the per-test limits and room for the longest expected output."""
    longest = max((len(output) for task in tasks if is_code_source(task.data_source)
                   for output in parse_tests(task.ground_truth).outputs), default=0)
    return dataclasses.replace(tool, timeout_s=test_timeout_s, cpu_time_s=math.ceil(test_timeout_s) + 1,
                               max_output_chars=max(tool.max_output_chars, longest + OUTPUT_MARGIN_CHARS))


def passes_tests(code: str, tests: StdioTests, sandbox) -> bool:
    """True iff `code` passes every test; batches of the pool's size, stopping at a failing batch."""
    cases = list(zip(tests.inputs, tests.outputs, strict=True))
    workers = sandbox.config.workers
    with ThreadPoolExecutor(max_workers=workers) as executor:
        for start in range(0, len(cases), workers):
            batch = cases[start:start + workers]
            results = list(executor.map(lambda case: sandbox.run(code, case[0]), batch))
            for result, (_, expected) in zip(results, batch, strict=True):
                if result.status == ExecStatus.INFRA_ERROR:
                    logger.warning("a test could not be run (%s); it counts as failed", result.stderr)
                if result.status != ExecStatus.OK or not same_output(result.stdout, expected):
                    return False
    return True


class Grader:
    """`reward_fn(response_text, ground_truth, data_source)` for the agent loop.

    `sandbox` runs the tests of code sources (a sandbox built from `grading_sandbox_config`); it may
    be None when no task is a code task.
    """

    def __init__(self, sandbox=None) -> None:
        self.sandbox = sandbox

    def __call__(self, response_text: str, ground_truth: str, data_source: str) -> RewardResult:
        if not is_code_source(data_source):
            return compute_reward(response_text, ground_truth, data_source)
        code = last_python_block(final_text(response_text))
        if code is None:
            return RewardResult(0.0, False, None)
        if self.sandbox is None:
            raise ValueError(f"a {data_source} task needs a grading sandbox")
        correct = passes_tests(code, parse_tests(ground_truth), self.sandbox)
        return RewardResult(float(correct), correct, code)


@contextlib.contextmanager
def grader_for(tasks: Sequence[GradedTask], tool: SandboxConfig, test_timeout_s: float) -> Iterator[Grader]:
    """The reward function of these tasks; a grading sandbox runs only if a task is a program."""
    if not any(is_code_source(task.data_source) for task in tasks):
        yield Grader()
        return
    try:
        grading = grading_sandbox_config(tool, test_timeout_s, tasks)
    except ValueError as error:
        raise JobError(f"a code task's ground truth is not stdin/stdout tests: {error}") from error
    with make_sandbox(grading) as sandbox:
        yield Grader(sandbox)


def final_answers(text: str, data_source: str) -> int:
    """How many final answers a turn's text holds in its source's answer format: ```python blocks for
    a code source, `\\boxed{}` answers (or an `Answer: X` line, multiple choice) otherwise. What the
    graders read is the last one; void-turn filtering and RoC's format penalty count them."""
    if is_code_source(data_source):
        return len(CODE_BLOCK.findall(text))
    boxed = text.count("\\boxed{")
    if boxed == 0 and "gpqa" in data_source.lower():
        return int(choice_letter(text) is not None)
    return boxed
