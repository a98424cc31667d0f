"""Rewards computed off the collection's event loop, each under a timeout (docs/architecture.md §5,
"Faults and load").

The agent loop awaits a rollout's reward while a thousand other rollouts go on; a reward must never
hold them up, and one that hangs must end the collection with one line, not stall it forever.

Design decisions:
- Where a reward runs:
  - in a reward worker process (workers.py, shared by every collection of this process): the
    built-in math grader, and a plain reward function loaded from the user's file (by its spec;
    the worker imports the file itself). A worker's main thread runs the call, so signal-based
    timeouts work there (math-verify's, which a user's verl reward function calls too, need the
    main thread), and a call past its timeout is killed with its worker;
  - on a thread of its own (calls.py's `ThreadCalls`): the program grader (its tests run in the
    grading sandbox, each under its own limit) and any reward callable handed in directly;
  - on the calls' own event loop (calls.py's `CoroutineCalls`): a coroutine reward function.
- The timeout (`--reward-timeout-s`, default 60 s) measures the call's own run, from when a worker
  or thread takes it. A reward past it raises `RewardTimeout`: one line naming the function and the
  rollout; the parts committed before stay and `--resume` finishes the iteration once it is fixed.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable

from cleaner.engine.grading.answers import RewardResult, compute_reward
from cleaner.engine.grading.programs import Grader, is_code_source
from cleaner.engine.grading.reward_file import RewardFunction, RewardFunctionError
from cleaner.engine.grading.workers import function_ref, reward_workers, spec_ref
from cleaner.errors import JobError
from cleaner.tools.calls import CoroutineCalls, DaemonThreads, Hung, LoopBlocked, ThreadCalls, Timed

REWARD_THREADS = 32  # in-process reward calls running at once
DEFAULT_REWARD_TIMEOUT_S = 60.0


class RewardTimeout(JobError):
    """A reward did not come back within its timeout; the message names the function and the rollout."""


async def _in_worker(ref: tuple[str, str], args: tuple, timeout_s: float) -> Timed:
    """What `ref` names, on `args`, in a reward worker, killed past `timeout_s` of its own run."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_WAITERS, reward_workers().call, ref, args, timeout_s)


_WAITERS = DaemonThreads("cleaner-reward-wait")  # a thread per call in a worker, waiting for its reply


# ---------------------------------------------------------------------------------------------
# A collection's rewards


class Rewards:
    """How one collection computes its rewards (module notes)."""

    def __init__(self, grader: Callable = compute_reward, reward_file: RewardFunction | None = None,
                 timeout_s: float = DEFAULT_REWARD_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.grader, self.reward_file, self.timeout_s = grader, reward_file, timeout_s
        self.threads = ThreadCalls(REWARD_THREADS, Hung(REWARD_THREADS), "cleaner-reward")
        self.coroutines = CoroutineCalls("the reward function")

    async def grade(self, rollout_id: str, text: str, ground_truth: str, data_source: str) -> RewardResult:
        """The built-in grader's reward (or the callable handed in) of a response's text."""
        in_worker = self.grader is compute_reward or (isinstance(self.grader, Grader)
                                                      and not is_code_source(data_source))
        arguments = (text, ground_truth, data_source)
        if in_worker:
            timed = await _in_worker(function_ref(compute_reward), arguments, self.timeout_s)
        else:
            timed = await self.threads.run(self.grader, arguments, self.timeout_s, "the reward")
        name = "the built-in grader" if in_worker or isinstance(self.grader, Grader) else _name(self.grader)
        if timed.timed_out:
            raise self._timeout(name, rollout_id)
        if timed.error is not None:
            raise timed.error
        return timed.value

    async def verl(self, rollout_id: str, data_source: str, solution: str, ground_truth: object,
                   extra_info: object) -> RewardResult:
        """The user's reward function on verl's arguments (reward_file.py checks what it returns)."""
        reward = self.reward_file
        # each call its own copies, whichever way it runs: the row's values stay as they were for its
        # other rollouts (a worker's are copies already, by pickle; a thread's or coroutine's are not)
        arguments = {"data_source": data_source, "solution_str": solution,
                     "ground_truth": copy.deepcopy(ground_truth), "extra_info": copy.deepcopy(extra_info)}
        if asyncio.iscoroutinefunction(reward.function):
            timed = await self.coroutines.run(lambda: reward.function(**arguments), self.timeout_s)
        elif reward.importable:
            timed = await _in_worker(spec_ref(reward.spec), (arguments,), self.timeout_s)
        else:
            timed = await self.threads.run(lambda: reward.function(**arguments), (), self.timeout_s,
                                           f"reward function {reward.name}")
        if timed.timed_out or isinstance(timed.error, LoopBlocked):  # its loop blocked by another call of it
            raise self._timeout(f"reward function {reward.name} ({reward.spec})", rollout_id)
        if isinstance(timed.error, Exception):
            error = timed.error
            raise RewardFunctionError(f"reward function {reward.name} ({reward.spec}) raised on rollout "
                                      f"{rollout_id}: {type(error).__name__}: {error}") from error
        if timed.error is not None:
            raise timed.error
        return reward.result(timed.value, rollout_id)

    def _timeout(self, name: str, rollout_id: str) -> RewardTimeout:
        return RewardTimeout(f"{name} did not return within {self.timeout_s:g} s on rollout {rollout_id} "
                             "(--reward-timeout-s); the parts committed stay, and --resume finishes the "
                             "iteration once it returns")

    def close(self) -> None:
        self.coroutines.close()


def _name(function: Callable) -> str:
    return f"reward {getattr(function, '__name__', type(function).__name__)}"
