"""The reference's own reward file, `recipe/cleaner/reward.py` of Open-CLEANER, unchanged, as the
paper's training scripts name it (`compute_score_outcome_reward`), on rollouts collected here.

It imports verl at its top, so it runs only where verl is importable and `CLEANER_REFERENCE` names a
checkout of the reference (docs/byo-task.md#the-references-reward-file has the recipe); the tests of
reward_file.py hold the contract without it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from cleaner.engine.collect.tasks import Task
from cleaner.engine.grading.reward_file import RewardFunction
from tests.agent_fakes import (
    BASE,
    CHAT,
    FakeSandbox,
    ScriptedBackend,
    answer,
    call,
    collect_parts,
    fake_reward,
)

REFERENCE = os.environ.get("CLEANER_REFERENCE")
pytestmark = pytest.mark.skipif(
    not REFERENCE or importlib.util.find_spec("verl") is None,
    reason="needs CLEANER_REFERENCE (an Open-CLEANER checkout) and verl importable (docs/byo-task.md)")


def test_the_references_reward_file_scores_rollouts_as_in_its_runs():
    function = RewardFunction.load(f"{REFERENCE}/recipe/cleaner/reward.py:compute_score_outcome_reward")
    scripts = {("right", 0): [call("Compute.", "print(6*7)"), answer("So the answer is \\boxed{42}.")],
               ("wrong", 0): [answer("I think \\boxed{41}.")],
               ("none", 0): [answer("No box here.")]}
    tasks = [Task(p, ({"role": "user", "content": "6*7?"},), "42", "math_dapo", extra_info={"index": i})
             for i, p in enumerate(("right", "wrong", "none"))]
    parts = collect_parts(tasks, BASE, ScriptedBackend(scripts, BASE), FakeSandbox(), CHAT, reward_fn=fake_reward,
                          progress=False, reward_file=function)
    stored = {r.prompt_id: (r.reward, r.correct, r.answer, json.loads(r.reward_details))
              for part in parts for r in part.rollouts}
    # math_dapo with strict_box_verify: 1 for the right boxed answer, -1 otherwise (its `pred` "" without one)
    assert stored == {"right": (1.0, True, "42", {"acc": True, "pred": "42"}),
                      "wrong": (-1.0, False, "41", {"acc": False, "pred": "41"}),
                      "none": (-1.0, False, "", {"acc": False, "pred": ""})}
