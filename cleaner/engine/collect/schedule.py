"""How the rollouts of a collection are run and committed (docs/architecture.md §5).

`collect` runs every planned rollout's story (agent.py) as a task of its own on one event loop and
yields the finished ones in parts of `batch_rollouts`, which the caller commits (the unit of resume).

Design decisions:
- Schedule `async` (the default): up to `max_concurrent_rollouts` rollouts are in flight, each on
  its own clock, as in verl's agent loop, slime and SkyRL; a finished rollout's slot goes to the
  next planned one at once. A rollout's requests go straight to the backend's request methods
  (`generate_async`, `score_async`: the engine batches whatever is running) and its calls to the
  sandbox pool (`run_async`: the pool's workers are the only limit), so no rollout waits for
  another's turn or tool, and a backend fault ends only the rollouts whose requests failed.
- Schedule `lockstep` (a debugging option and the benchmarks' baseline): the rollouts run in batches
  of `batch_rollouts`, one after the other, and inside a batch every generation and every tool
  round waits at a barrier for every live rollout of the batch (`LockstepRequests`), so each turn
  is one request per rollout sent together with the batch's largest token limit, then one round of
  tool calls; a part is a batch.
- What a rollout contains never depends on the schedule: seeds are hashes of (seed, iteration,
  prompt, sample, turn), and a limit cut from a longer request is a prefix of the same sample.
  Parts hold the rollouts that finished, in plan order within the part; which rollouts share a
  part depends on the finishing order, the warehouse's rows do not.
- The event loop is the backend's own where it has one (SGLang's in-process engine receives its
  results there), else a new one. `collect` is a plain generator: between two parts the loop does
  not run (the caller writes the part meanwhile), while requests already sent go on in the engine,
  the decoding thread or the sandbox's threads, and are picked up when it runs again.
- Progress: rollouts finished of planned, in flight (and how many wait on their tools), and the
  generated tokens per second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from tqdm import tqdm

from cleaner.config import CollectConfig, Schedule
from cleaner.engine.collect.agent import (
    CollectedBatch,
    Phase,
    RolloutState,
    Story,
    cut_generation,
    plan_rollouts,
    run_rollout,
)
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.model.base import Generation, SamplingParams
from cleaner.engine.model.chat import ChatFormat
from cleaner.records import Rollout

if TYPE_CHECKING:
    from cleaner.engine.collect.tasks import Task
    from cleaner.engine.grading.reward_file import RewardFunction
    from cleaner.sandbox import ExecResult
    from cleaner.tools import Toolbox, ToolOutcome

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5  # the bar's in-flight and tokens/s figures are refreshed at most this often


def collect(
    tasks: Sequence[Task],
    config: CollectConfig,
    backend,
    sandbox,
    chat: ChatFormat,
    *,
    reward_fn: Callable = compute_reward,
    skip_rollout_ids: frozenset[str] = frozenset(),
    on_context: Callable[[str, list[int]], None] | None = None,
    progress: bool = True,
    rollout_prefix: str = "",
    strict_context: bool = True,
    toolbox: Toolbox | None = None,
    reward_file: RewardFunction | None = None,
) -> Iterator[CollectedBatch]:
    """Run config.group_size rollouts per task; yield the finished ones in parts of
    config.batch_rollouts (the last part may be smaller).

    `toolbox` holds the user's tools beside the code interpreter (their schemas must be in `chat`'s
    template: `ChatFormat(tokenizer, toolbox.schemas)`), and `reward_file` the user's reward
    function, which replaces `reward_fn`. `rollout_prefix` is put before every rollout and group id (an evaluation's id keeps its rollouts
    apart from every other's); seeds do not depend on it. Before anything is generated, every prompt
    is checked against the backend's context length (`context.fit_prompts`): with `strict_context`
    (collect, run) a prompt that leaves less than the response budget is a ContextError (or is
    truncated, with `config.truncate_prompts`); without it (eval) that is a warning, and
    generations stop at the context's end.
    """
    states = plan_rollouts(tasks, config, chat, skip_rollout_ids, rollout_prefix, backend.context_length,
                           strict_context)
    logger.info("collecting %d rollouts (%d skipped as already stored), schedule %s", len(states),
                len(tasks) * config.group_size - len(states), config.schedule)
    story = Story(config, chat, backend.context_length, reward_fn, backend.policy_version, on_context,
                  toolbox, reward_file)
    loop = backend.event_loop
    own_loop = loop is None
    if own_loop:
        loop = asyncio.new_event_loop()
    run = _Run(states, story, backend, sandbox)
    bar = tqdm(total=len(states), desc="collect", unit="rollout", disable=not progress)
    try:
        while (part := loop.run_until_complete(run.next_part(bar))) is not None:
            yield part
    finally:
        bar.close()
        loop.run_until_complete(run.stop())
        if own_loop:
            loop.close()


# ---------------------------------------------------------------------------------------------
# The run: rollouts in flight, finished ones in parts


class _Run:
    """The planned rollouts, those in flight and those finished but not yet handed out."""

    def __init__(self, states: list[RolloutState], story: Story, backend, sandbox) -> None:
        self.story, self.backend, self.sandbox = story, backend, sandbox
        self.config = story.config
        self.order = {state.rollout_id: index for index, state in enumerate(states)}
        self.waiting = deque(states)
        self.running: dict[asyncio.Task, RolloutState] = {}
        self.finished: list[tuple[Rollout, RolloutState]] = []
        self.tokens = TokenCounter()
        self.lock_steps: list[LockstepRequests] = []  # the lock step of the batch in flight
        self.started = time.monotonic()
        self.shown = 0.0

    async def next_part(self, bar: tqdm) -> CollectedBatch | None:
        """Run until `batch_rollouts` rollouts have finished (or all have); None when none is left."""
        size = self.config.batch_rollouts
        while len(self.finished) < size and (self.waiting or self.running):
            self._start()
            done, _ = await asyncio.wait(self.running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                state = self.running.pop(task)
                self.finished.append((task.result(), state))  # a rollout's story raises only on a bug
            bar.update(len(done))
            self._show(bar)
        if not self.finished:
            return None
        part, self.finished = self.finished[:size], self.finished[size:]
        part.sort(key=lambda pair: self.order[pair[1].rollout_id])
        return CollectedBatch([rollout for rollout, _ in part],
                              [segment for _, state in part for segment in state.segments])

    def _start(self) -> None:
        """Start rollouts: async, as slots free; lock step, a whole batch once the last one ended."""
        if self.config.schedule == Schedule.LOCKSTEP:
            if self.running:
                return
            batch = [self.waiting.popleft() for _ in range(min(self.config.batch_rollouts, len(self.waiting)))]
            requests = LockstepRequests(self.backend, self.sandbox, self.tokens, len(batch), self.story.toolbox)
            self.lock_steps = [requests]
            for state in batch:
                self._launch(state, requests)
            return
        requests = DirectRequests(self.backend, self.sandbox, self.tokens, self.story.toolbox)
        while self.waiting and len(self.running) < self.config.max_concurrent_rollouts:
            self._launch(self.waiting.popleft(), requests)

    def _launch(self, state: RolloutState, requests: DirectRequests) -> None:
        async def story() -> Rollout:
            try:
                return await run_rollout(state, self.story, requests)
            finally:
                requests.leave(state)  # if its story did not say so itself (an error)

        self.running[asyncio.get_running_loop().create_task(story(), name=state.rollout_id)] = state

    def _show(self, bar: tqdm) -> None:
        now = time.monotonic()
        if now - self.shown < PROGRESS_EVERY_S and self.waiting:
            return
        self.shown = now
        tools = sum(state.phase == Phase.TOOL for state in self.running.values())
        rate = self.tokens.generated / max(now - self.started, 1e-9)
        bar.set_postfix_str(f"in flight {len(self.running)} ({tools} in tools), {rate:,.0f} tok/s", refresh=False)

    async def stop(self) -> None:
        """Cancel what is still running (an interrupted collection) and close the backend's
        connections on this loop."""
        for requests in self.lock_steps:
            requests.closed = True  # the cancelled stories' leaving releases nothing more
        while tasks := [*self.running, *(task for requests in self.lock_steps for task in requests.sent)]:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.running.clear()
        await self.backend.close_requests()


@dataclasses.dataclass
class TokenCounter:
    generated: int = 0  # tokens the backend has generated for this collection so far


# ---------------------------------------------------------------------------------------------
# What a rollout awaits


class DirectRequests:
    """Each request straight to the backend or the sandbox, as soon as the rollout makes it."""

    def __init__(self, backend, sandbox, tokens: TokenCounter, toolbox: Toolbox | None = None) -> None:
        self.backend, self.sandbox, self.tokens, self.toolbox = backend, sandbox, tokens, toolbox

    async def generate(self, state: RolloutState, context: list[int], params: SamplingParams,
                       seed: int) -> Generation:
        generation = await self.backend.generate_async(context, params, seed, session=state.rollout_id)
        self.tokens.generated += len(generation.token_ids)
        return generation

    async def score(self, state: RolloutState, sequences: Sequence[Sequence[int]],
                    starts: Sequence[int]) -> list[list[float]]:
        return await self.backend.score_async(sequences, starts, session=state.rollout_id)

    async def run_code(self, code: str) -> ExecResult:
        return await self.sandbox.run_async(code)

    async def run_tool(self, name: str, arguments: dict) -> ToolOutcome:
        return await self.toolbox.run(name, arguments)

    def leave(self, state: RolloutState) -> None:
        """A rollout needs no more turns (nothing to do when nobody waits for it)."""


class LockstepRequests(DirectRequests):
    """A batch's rollouts meet before every generation and every tool round: the requests are held
    until every live rollout of the batch waits in one (tool calls first, then generations), then
    sent together, the generations with the largest limit among them, each cut to its own."""

    def __init__(self, backend, sandbox, tokens: TokenCounter, live: int, toolbox: Toolbox | None = None) -> None:
        super().__init__(backend, sandbox, tokens, toolbox)
        self.live = live
        self.left: set[str] = set()  # rollouts that need no more turns
        self.closed = False  # the collection is stopping: nothing more is released
        self.sent: set[asyncio.Task] = set()  # requests released and not yet answered
        self.generations: list[tuple[RolloutState, list[int], SamplingParams, int, asyncio.Future]] = []
        self.calls: list[tuple[Callable[[], Awaitable], asyncio.Future]] = []  # (the call's request, its answer)

    async def generate(self, state: RolloutState, context: list[int], params: SamplingParams,
                       seed: int) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self.generations.append((state, context, params, seed, future))
        self._release()
        return await future

    async def run_code(self, code: str) -> ExecResult:
        return await self._hold_call(lambda: DirectRequests.run_code(self, code))

    async def run_tool(self, name: str, arguments: dict) -> ToolOutcome:
        return await self._hold_call(lambda: DirectRequests.run_tool(self, name, arguments))

    async def _hold_call(self, request: Callable[[], Awaitable]):
        future = asyncio.get_running_loop().create_future()
        self.calls.append((request, future))
        self._release()
        return await future

    def leave(self, state: RolloutState) -> None:
        if state.rollout_id in self.left:
            return
        self.left.add(state.rollout_id)
        self.live -= 1
        self._release()

    def _release(self) -> None:
        if self.closed or len(self.generations) + len(self.calls) < self.live:
            return
        if self.calls:
            calls, self.calls = self.calls, []
            for request, future in calls:
                self._send(future, request())
        elif self.generations:
            held, self.generations = self.generations, []
            limit = max(params.max_new_tokens for _, _, params, _, _ in held)
            for state, context, params, seed, future in held:
                turn = super().generate(state, context, dataclasses.replace(params, max_new_tokens=limit), seed)
                self._send(future, _cut_to(turn, params.max_new_tokens))

    def _send(self, future: asyncio.Future, request) -> None:
        """Run `request` (a coroutine) as a task; its result or error goes to `future`."""
        task = asyncio.get_running_loop().create_task(request)
        self.sent.add(task)

        def settle(done: asyncio.Task) -> None:
            self.sent.discard(done)
            if future.done():
                return
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(done.result())

        task.add_done_callback(settle)


async def _cut_to(turn, limit: int) -> Generation:
    return cut_generation(await turn, limit)
