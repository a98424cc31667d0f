"""Rewards off the event loop, each under a timeout (grading/runner.py): the built-in grader in a
reward worker process, a callable on a thread, a coroutine on its own loop; past the timeout, one
line naming the reward and the rollout."""

from __future__ import annotations

import asyncio
import time

import pytest

from cleaner.engine.grading import workers
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.grading.reward_file import RewardFunction, RewardFunctionError
from cleaner.engine.grading.runner import Rewards, RewardTimeout


@pytest.mark.parametrize(("text", "truth"), [("so \\boxed{1/2}", "0.5"), ("\\boxed{42}", "41"), ("none", "1")])
def test_the_built_in_grader_runs_in_a_worker_and_grades_as_it_does_here(text, truth):
    got = asyncio.run(Rewards().grade("r0", text, truth, "math"))
    assert got == compute_reward(text, truth, "math")
    busy = [worker for worker in workers.reward_workers()._all if worker.process is not None]
    assert busy and all(worker.process.poll() is None for worker in busy)  # it ran in a worker, still warm


def test_a_hanging_callable_is_one_line_naming_it_and_the_rollout():
    def slow_grader(text, truth, source):
        time.sleep(30)

    started = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"^reward slow_grader did not return within 0.3 s on rollout r7 "
                                            r"\(--reward-timeout-s\); the parts committed stay"):
        asyncio.run(Rewards(slow_grader, timeout_s=0.3).grade("r7", "x", "1", "toy"))
    assert time.monotonic() - started < 5


def test_a_coroutine_reward_function_past_its_timeout_and_one_that_kills_its_worker(tmp_path):
    async def judge(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(30)

    with pytest.raises(RewardTimeout, match=r"^reward function judge \(judge.py:judge\) did not return within 0.2 s "
                                            r"on rollout r1"):
        asyncio.run(Rewards(reward_file=RewardFunction("judge.py:judge", judge), timeout_s=0.2)
                    .verl("r1", "toy", "x", "1", {}))
    path = tmp_path / "dies.py"
    path.write_text("import os\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    os._exit(3)\n")
    with pytest.raises(RewardFunctionError, match=r"raised on rollout r2: WorkerLost: its worker process died \(exit "
                                                  r"code 3\)"):
        asyncio.run(Rewards(reward_file=RewardFunction.load(str(path))).verl("r2", "toy", "x", "1", {}))
    # the pool replaced the worker: the next reward is computed
    assert asyncio.run(Rewards().grade("r3", "\\boxed{2}", "2", "math")).correct


def test_a_script_that_collects_at_its_top_level_needs_no_main_guard(tmp_path):
    """Reward workers are processes of cleaner's own: they never import the caller's script again
    (multiprocessing's spawn would, and run a top-level collection once per worker)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import asyncio\n"
                      "from cleaner.engine.grading.runner import Rewards\n"
                      "print('graded', asyncio.run(Rewards().grade('r', '\\\\boxed{4}', '4', 'math')).correct)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["graded True"]
