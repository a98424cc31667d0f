"""The unit-conversion task's reward, a verl reward file (docs/byo-task.md).

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` with the response
decoded without special tokens, tool calls and tool responses included; cleaner calls it the same
way (`--reward-fn examples/units/reward.py:compute_score`). The answer is the last \\boxed{...};
it is right within the row's relative tolerance (extra_info["rel_tol"]). The dict's `score` is the
reward; `acc` and `pred` become the rollout's `correct` and `answer`, and every other key is kept
in the warehouse's reward_details column.
"""

import math
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    boxed = BOXED.findall(solution_str)
    pred = boxed[-1].strip() if boxed else None
    number = NUMBER.search(pred) if pred else None
    rel_tol = (extra_info or {}).get("rel_tol", 1e-6)
    acc = number is not None and math.isclose(float(number.group()), float(ground_truth), rel_tol=rel_tol)
    return {
        "score": 1.0 if acc else 0.0,
        "acc": acc,
        "pred": pred,
        # the calls the model kept in its context (a Qwen tokenizer keeps <tool_call> in solution_str;
        # a tokenizer for which it is a special token drops it, so count the call's JSON instead)
        "convert_calls": solution_str.count('"name": "convert_units"'),
        "failed_calls": solution_str.count("Tool call failure"),
    }
