"""Rewards computed off the collection's event loop, each under a timeout (docs/architecture.md §5,
"Faults and load").

The agent loop awaits a rollout's reward while a thousand other rollouts go on; a reward must never
hold them up, and one that hangs must end the collection with one line, not stall it forever.

Design decisions:
- Where a reward runs:
  - in a worker process (`reward_pool`, spawned, `REWARD_WORKERS` of them, shared by every
    collection of this process): the built-in math grader, and a plain reward function loaded from
    the user's file (by its spec; the worker imports the file itself). A worker's main thread runs
    the call, so signal-based timeouts work there (math-verify's, which a user's verl reward
    function calls too, need the main thread), and a call past its timeout is killed with its
    worker, which the pool replaces;
  - on a thread of its own (calls.py's `ThreadCalls`): the program grader (its tests run in the
    grading sandbox, each under its own limit) and any reward callable handed in directly;
  - on the calls' own event loop (calls.py's `CoroutineCalls`): a coroutine reward function.
- The timeout (`--reward-timeout-s`, default 60 s) measures the call's own run, from when a worker
  or thread takes it. A reward past it raises `RewardTimeout`: one line naming the function and the
  rollout; the parts committed before stay and `--resume` finishes the iteration once it is fixed.
- Workers ignore SIGINT: a Ctrl-C is the collection's to handle (it cancels what waits on them).
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable

from cleaner.engine.grading.answers import RewardResult, compute_reward
from cleaner.engine.grading.programs import Grader, is_code_source
from cleaner.engine.grading.reward_file import RewardFunction, RewardFunctionError
from cleaner.errors import JobError
from cleaner.tools.calls import CoroutineCalls, ThreadCalls, Timed

REWARD_WORKERS = min(8, os.cpu_count() or 1)  # worker processes computing rewards at once
REWARD_THREADS = 32  # in-process reward calls running at once
DEFAULT_REWARD_TIMEOUT_S = 60.0


class RewardTimeout(JobError):
    """A reward did not come back within its timeout; the message names the function and the rollout."""


# ---------------------------------------------------------------------------------------------
# The worker processes


_pool = None
_pool_lock = threading.Lock()


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def reward_pool():
    """This process's pool of reward workers, started on first use and stopped at exit."""
    global _pool
    import pebble  # on first use: a collection with an in-process reward starts no worker

    with _pool_lock:
        if _pool is None or not _pool.active:
            _pool = pebble.ProcessPool(max_workers=REWARD_WORKERS, initializer=_ignore_interrupts,
                                       context=multiprocessing.get_context("spawn"))
        return _pool


@atexit.register
def _stop_pool() -> None:
    with _pool_lock:
        if _pool is not None and _pool.active:
            _pool.stop()


def _call_spec(spec: str, arguments: dict) -> object:
    """In a worker: the reward function `spec` names, called with verl's keywords. Loaded each call
    (plugins.py imports a file once per content), so a file fixed since a worker took it is read
    again."""
    return RewardFunction.load(spec).function(**arguments)


async def _in_worker(fn: Callable, args: tuple, timeout_s: float) -> Timed:
    """`fn(*args)` in a reward worker, killed past `timeout_s` of its own run."""
    import pebble  # loaded with the pool

    future = reward_pool().schedule(fn, args=args, timeout=timeout_s)
    try:
        value = await asyncio.wrap_future(future)
    except TimeoutError:
        return Timed(seconds=timeout_s, timed_out=True)
    except pebble.ProcessExpired as error:  # the worker died under the call (a crash in C code, an exit)
        return Timed(error=RuntimeError(f"its worker process died ({error})"))
    except asyncio.CancelledError:
        future.cancel()  # pebble stops the worker of a running task
        raise
    except Exception as error:  # noqa: BLE001 - what the reward raised, the caller's to word
        return Timed(error=error)
    return Timed(value)


# ---------------------------------------------------------------------------------------------
# A collection's rewards


class Rewards:
    """How one collection computes its rewards (module notes)."""

    def __init__(self, grader: Callable = compute_reward, reward_file: RewardFunction | None = None,
                 timeout_s: float = DEFAULT_REWARD_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.grader, self.reward_file, self.timeout_s = grader, reward_file, timeout_s
        self.threads = ThreadCalls(REWARD_THREADS, REWARD_THREADS, "cleaner-reward")
        self.coroutines = CoroutineCalls("cleaner-reward")

    async def grade(self, rollout_id: str, text: str, ground_truth: str, data_source: str) -> RewardResult:
        """The built-in grader's reward (or the callable handed in) of a response's text."""
        in_worker = self.grader is compute_reward or (isinstance(self.grader, Grader)
                                                      and not is_code_source(data_source))
        arguments = (text, ground_truth, data_source)
        if in_worker:
            timed = await _in_worker(compute_reward, arguments, self.timeout_s)
        else:
            timed = await self.threads.run(self.grader, arguments, self.timeout_s, "the reward")
        name = "the built-in grader" if in_worker or isinstance(self.grader, Grader) else _name(self.grader)
        if timed.timed_out:
            raise self._timeout(name, rollout_id)
        if timed.error is not None:
            raise timed.error
        return timed.value

    async def verl(self, rollout_id: str, data_source: str, solution: str, ground_truth: str,
                   extra_info: object) -> RewardResult:
        """The user's reward function on verl's arguments (reward_file.py checks what it returns)."""
        reward = self.reward_file
        arguments = {"data_source": data_source, "solution_str": solution, "ground_truth": ground_truth,
                     "extra_info": copy.deepcopy(extra_info)}  # the row's own stays as it was
        if asyncio.iscoroutinefunction(reward.function):
            timed = await self.coroutines.run(lambda: reward.function(**arguments), self.timeout_s)
        elif reward.importable:
            timed = await _in_worker(_call_spec, (reward.spec, arguments), self.timeout_s)
        else:
            timed = await self.threads.run(lambda: reward.function(**arguments), (), self.timeout_s,
                                           f"reward function {reward.name}")
        if timed.timed_out:
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
