"""Outcome rewards: 1.0 for a correct final answer, 0.0 otherwise.

Design decisions:
- Only the FINAL assistant text counts: the text after the last `</tool_response>`, so a number
  the tool printed (or a `\\boxed{}` inside code) is never mistaken for the model's answer.
- Toy and math sources: the last `\\boxed{...}` (nested braces handled) is compared with the ground
  truth by the math-verify package (`parse` + `verify`), so `\\boxed{1/2}` matches `0.5`.
- Multiple choice (`data_source` containing "gpqa"): the chosen letter, from the last
  `\\boxed{X}` or else the last `Answer: X`, compared case-insensitively with the truth's letter.
- math-verify guards its parser with SIGALRM timeouts, which only work in the main thread; off the
  main thread the timeouts are disabled rather than crashing the worker.
- The result carries its parts (`correct`, the extracted `answer`), not just the number.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from cleaner.engine.model.chat import IM_END, TOOL_RESPONSE_CLOSE

_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:：]?\s*\(?([A-Za-z])\)?(?![A-Za-z])", re.IGNORECASE)
_LETTER = re.compile(r"^\(?\s*(?:\\text\{\s*)?\(?([A-Za-z])\)?\s*\}?\s*\)?$")


@dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    answer: str | None  # the extracted final answer; None if there is none
    details: str | None = None  # a reward function's dict beyond its score, as JSON (reward_file.py)


def final_text(response_text: str) -> str:
    """The last assistant turn: everything after the last tool response, without <|im_end|>."""
    cut = response_text.rfind(TOOL_RESPONSE_CLOSE)
    tail = response_text[cut + len(TOOL_RESPONSE_CLOSE):] if cut >= 0 else response_text
    return tail.replace(IM_END, "")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip()
            depth -= 1
    return None  # unclosed


def _math_equal(ground_truth: str, answer: str) -> bool:
    from math_verify import (  # sympy and latex2sympy cost start-up time: loaded on first use
        parse,
        verify,
    )

    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
    predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if not gold or not predicted:
        return ground_truth.strip() == answer.strip()
    return bool(verify(gold, predicted, timeout_seconds=timeout))


def choice_letter(text: str) -> str | None:
    """The chosen option letter: last \\boxed{X}, else the last `Answer: X`."""
    boxed = last_boxed(text)
    if boxed is not None:
        match = _LETTER.match(boxed)
        return match.group(1).upper() if match else None
    matches = _ANSWER_LINE.findall(text)
    return matches[-1].upper() if matches else None


def compute_reward(response_text: str, ground_truth: str, data_source: str) -> RewardResult:
    """Score a whole response (all turns) against the ground truth of its task."""
    text = final_text(response_text)
    if "gpqa" in data_source.lower():
        letter = choice_letter(text)
        truth = choice_letter(f"\\boxed{{{ground_truth.strip()}}}")
        correct = letter is not None and letter == truth
        return RewardResult(float(correct), correct, letter)
    answer = last_boxed(text)
    if answer is None or answer == "":
        return RewardResult(0.0, False, None)
    correct = _math_equal(ground_truth, answer)
    return RewardResult(float(correct), correct, answer)
