"""A reward function from the user's file, called as verl calls one (docs/byo-task.md).

`--reward-fn PATH.py:NAME` (`PATH.py` alone means `compute_score`, verl's default name) loads
`NAME(data_source, solution_str, ground_truth, extra_info)` from the file, verl's
`custom_reward_function.path` / `.name`, and the rollouts' rewards are what it returns.

Design decisions:
- The arguments are verl's reward managers' (naive and DAPO; the paper trained with DAPO's):
  `data_source` and `ground_truth` of the dataset row, `solution_str` the response decoded
  without special tokens (`skip_special_tokens=True`): everything after the prompt that the model
  saw and wrote, its calls and the tools' responses included. With SAAR in the collect view that is
  the purified context, as the reference's agent loop hands its rolled-back response to the
  reward; in the raw view it is every attempt. `extra_info` is a copy of the row's `extra_info`
  (a dict; `{}` without one) with what verl's naive and DAPO reward managers add: `num_turns`, the
  trajectory's generations and tool responses plus one (verl's count of the messages after the
  system prompt), and `rollout_reward_scores`, the tools' rewards for the rollout ({tool: what its
  `release` returned}, a verl tool's `calc_reward`, as verl's SGLang rollout filled it; `{}`
  without, as the reference's agent loop always passes), and `tool_rewards`, the calls' step
  rewards in order (verl tools' `execute` returns one; the reference's agent loop keeps them
  under that name). `ground_truth` is the row's as it was stored in the file: a string, a
  number, a dict of a struct, a list (collect/tasks.py).
- It returns a number (a bool, an int, a float, a numpy scalar) or a dict with a `score` key, as
  verl takes either. NaN, infinity and a number a float32 column cannot hold (beyond +-3.4e38: it
  would be stored as infinity and turn the advantages into NaN) are not rewards. A dict's other
  keys are the rollout's `reward_details` (JSON, queryable with DuckDB's `->>`); its `acc`, where
  there is one, is the rollout's `correct` (else score > 0) and its `pred` the rollout's `answer`.
  Both numbers are read strictly: `score` a finite number, `acc` a bool or a finite number (correct
  when > 0, as score is read without it); anything else (`acc: "no"`, which Python's truth would
  make correct) is one error line naming the key.
- A function that raises, or returns anything else, stops the collection with one
  `RewardFunctionError` line naming the function, the rollout and the exception; the parts
  committed before stay, and `--resume` goes on from them once the function is fixed.
- Where it runs, and under which timeout, is runner.py's business: a plain function in a reward
  worker process (whose main thread runs it, so signal-based timeouts such as math-verify's work),
  a coroutine function on an event loop of its own; the collection's loop never waits on either.
- The built-in grader (answers.py, programs.py) stays the default.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cleaner.engine.grading.answers import RewardResult
from cleaner.plugins import PluginError, load_object, plain

DEFAULT_NAME = "compute_score"  # verl's custom_reward_function.name default


class RewardFunctionError(PluginError):
    """The user's reward function broke its contract on a rollout; the message names both."""


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function and the spec it came from."""

    spec: str
    function: Callable
    importable: bool = False  # loaded from `spec` (load()): a reward worker can load it by its spec too

    @classmethod
    def load(cls, spec: str) -> RewardFunction:
        """The function `spec` names; a PluginError line if it cannot be loaded or called."""
        function = load_object(spec, "reward function", DEFAULT_NAME)
        if not callable(function):
            raise PluginError(f"reward function {spec!r}: {type(function).__name__} is not callable")
        try:
            inspect.signature(function).bind(data_source="", solution_str="", ground_truth="", extra_info={})
        except TypeError as error:
            raise PluginError(f"reward function {spec!r}: it must take (data_source, solution_str, ground_truth, "
                              f"extra_info) as keywords, as verl calls it ({error})") from None
        except ValueError:  # a builtin without a signature: called as it is
            pass
        return cls(spec, function, importable=True)

    @property
    def name(self) -> str:
        return getattr(self.function, "__name__", self.spec)

    async def score(self, rollout_id: str, data_source: str, solution_str: str, ground_truth: object,
                    extra_info: object) -> RewardResult:
        """The rollout's reward; RewardFunctionError if the function raises or returns no number. The
        function gets its own copies of the row's values (one call's changes never reach the next)."""
        try:
            result = self.function(data_source=data_source, solution_str=solution_str,
                                   ground_truth=copy.deepcopy(ground_truth), extra_info=copy.deepcopy(extra_info))
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:  # noqa: BLE001 - the user's function: one line naming it and the rollout
            raise RewardFunctionError(f"reward function {self.name} ({self.spec}) raised on rollout {rollout_id}: "
                                      f"{type(error).__name__}: {error}") from error
        return self.result(result, rollout_id)

    def result(self, result: object, rollout_id: str) -> RewardResult:
        """What the function returned, as a rollout's reward; RewardFunctionError if it is not one."""
        details = None
        if isinstance(result, Mapping):
            if "score" not in result:
                raise self._bad(rollout_id, f"a dict without a 'score' key (keys: {sorted(map(str, result))})")
            details = {str(key): value for key, value in result.items() if key != "score"}
            score = result["score"]
        else:
            score = result
        score = plain(score)  # a numpy scalar (np.float32, np.bool_) as Python's
        if not isinstance(score, numbers.Real) or not _float32(score):
            raise self._bad(rollout_id, f"{type(score).__name__} {score!r:.80}, not a finite number a "
                                        f"float32 holds (|x| <= {FLOAT32_MAX:.4g})")
        score = float(score)
        if details is None:
            return RewardResult(score, score > 0, None)
        correct = self._acc(details["acc"], rollout_id) if "acc" in details else score > 0
        pred = details.get("pred")
        answer = None if pred is None else str(plain(pred))
        text = json.dumps(plain(details), sort_keys=True, ensure_ascii=False, default=str)
        return RewardResult(score, correct, answer, text)

    def _acc(self, acc: object, rollout_id: str) -> bool:
        """A dict's `acc` as the rollout's `correct`: a bool, or a finite number (> 0: correct)."""
        acc = plain(acc)
        if isinstance(acc, bool):
            return acc
        if isinstance(acc, numbers.Real) and _float32(acc):
            return acc > 0
        raise self._bad(rollout_id, f"a dict whose 'acc' is {type(acc).__name__} {acc!r:.80}, not a bool or a finite "
                                    "number,", "a dict's 'acc' (the rollout's correct) is a bool or a number")

    def _bad(self, rollout_id: str, what: str,
             rule: str = "it must return a number or a dict with a 'score' number") -> RewardFunctionError:
        return RewardFunctionError(f"reward function {self.name} ({self.spec}) returned {what} on rollout "
                                   f"{rollout_id}; {rule}")


FLOAT32_MAX = 3.4028234663852886e38  # rewards are stored as float32 (the warehouse's `reward`)


def _float32(score: numbers.Real) -> bool:
    """A finite number a float32 column stores as a finite number."""
    try:
        value = float(score)
    except OverflowError:  # an int beyond any float (10**400)
        return False
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def verl_extra_info(row_extra_info: object, num_turns: int, rollout_reward_scores: Mapping[str, object] | None = None,
                    tool_rewards: list[float] | None = None) -> object:
    """What verl hands a reward function as `extra_info`: the row's dict (a copy) with `num_turns`,
    `rollout_reward_scores` ({tool: its reward for the rollout}) and `tool_rewards` (the calls' step
    rewards, in order)."""
    added = {"num_turns": num_turns, "rollout_reward_scores": dict(rollout_reward_scores or {}),
             "tool_rewards": list(tool_rewards or [])}
    if row_extra_info is None:
        return added
    if isinstance(row_extra_info, Mapping):
        return {**row_extra_info, **added}
    return row_extra_info
