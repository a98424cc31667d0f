"""How the rollouts of a collection are run and committed (docs/architecture.md §5).

`collect` runs every planned rollout (agent.py's run_rollout) as a task of its own on one event
loop and hands the finished ones, in parts of `batch_rollouts`, to `write` on a thread of its own (the unit of
resume). It returns what it wrote, or stops with one line (`CollectionStopped`).

Design decisions:
- Schedule `async` (the default): up to `max_concurrent_rollouts` rollouts are in flight, each on
  its own clock, as in verl's agent loop, slime and SkyRL; a finished rollout's slot goes to the
  next planned one at once. A rollout's requests go straight to the backend's request methods
  (`generate_async`, `score_async`: the engine batches whatever is running) and its calls to the
  sandbox pool (`run_async`: the pool's workers are the only limit), so no rollout waits for
  another's turn or tool.
- Schedule `lockstep` (a debugging option and the benchmarks' baseline): the rollouts run in batches
  of `batch_rollouts`, one after the other, and inside a batch every generation and every tool
  round waits at a barrier for every live rollout of the batch (`LockstepRequests`), so each turn
  is one request per rollout sent together with the batch's largest token limit, then one round of
  tool calls; a part is a batch.
- What a rollout contains never depends on the schedule: seeds are hashes of (seed, iteration,
  prompt, sample, turn), and a limit cut from a longer request is a prefix of the same sample.
  Parts hold the rollouts that finished, in plan order within the part; which rollouts share a
  part depends on the finishing order, the warehouse's rows do not.
- The loop never waits on the disk: parts go to a writer thread through a queue of at most
  `MAX_PENDING_PARTS` (`PartWriter`); only when that many wait does the schedule wait to hand over
  the next, while the rollouts in flight go on. Nor on the user's code: tools and rewards run off
  it, timed by their own clocks (tools/calls.py, grading/runner.py).
- Faults: a rollout whose request failed after the backend's own retries (`InfraFault`) is not
  finished: it is not written, and `--resume` collects it again. `Faults` keeps the outcome of the
  last `FAULT_WINDOW` requests (generations, scores and tool calls, an infrastructure fault being a
  failure): once at least `MIN_FAULTS` of them, and at least `MAX_FAULT_SHARE` of them, failed, the
  collection stops. Either way, and on a Ctrl-C, every rollout that finished before is written
  (a last part holds those not yet handed over), and `CollectionStopped` says in one line what is
  committed and that `--resume` finishes it.
- The event loop is the backend's own where it has one (SGLang's in-process engine receives its
  results there), else a new one.
- Progress: rollouts finished of planned, in flight (and how many wait on their tools), and the
  generated tokens per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from tqdm import tqdm

from cleaner.config import CollectConfig, Schedule
from cleaner.engine.collect.agent import (
    CollectedBatch,
    CollectionSetup,
    InfraFault,
    Phase,
    RolloutState,
    cut_generation,
    plan_rollouts,
    run_rollout,
)
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.grading.runner import Rewards
from cleaner.engine.model.base import Generation, SamplingParams
from cleaner.engine.model.chat import ChatFormat
from cleaner.errors import CollectionStopped, Interrupted
from cleaner.interrupts import deferred, say_stopping
from cleaner.records import Rollout, ToolStatus

if TYPE_CHECKING:
    from cleaner.engine.collect.tasks import Task
    from cleaner.engine.grading.reward_file import RewardFunction
    from cleaner.sandbox import ExecResult
    from cleaner.tools import Toolbox, ToolOutcome
    from cleaner.tools.base import CallContext

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5  # the bar's in-flight and tokens/s figures are refreshed at most this often
MAX_PENDING_PARTS = 2  # finished parts waiting for the writer before the schedule waits to hand one over
FAULT_WINDOW = 64  # the last requests the fault share is measured over
MAX_FAULT_SHARE = 0.5  # a share of failed requests in the window that stops the collection ...
MIN_FAULTS = 8  # ... once at least this many of them failed
STOPPING = "committing the parts already finished"  # what a further Ctrl-C says while a collection stops


@dataclasses.dataclass(frozen=True)
class CollectionCounts:
    """What a collection wrote."""

    n_rollouts: int  # rollouts written
    n_parts: int  # parts written


def collect(
    tasks: Sequence[Task],
    config: CollectConfig,
    backend,
    sandbox,
    chat: ChatFormat,
    *,
    write: Callable[[CollectedBatch], None],
    reward_fn: Callable = compute_reward,
    skip_rollout_ids: frozenset[str] = frozenset(),
    on_context: Callable[[str, list[int]], None] | None = None,
    progress: bool = True,
    rollout_prefix: str = "",
    strict_context: bool = True,
    toolbox: Toolbox | None = None,
    reward_file: RewardFunction | None = None,
) -> CollectionCounts:
    """Run config.group_size rollouts per task; `write` the finished ones in parts of
    config.batch_rollouts (the last part may be smaller), on a thread of its own.

    `toolbox` holds the user's tools beside the code interpreter (their schemas must be in `chat`'s
    template: `ChatFormat(tokenizer, toolbox.schemas)`), and `reward_file` the user's reward
    function, which replaces `reward_fn`. `rollout_prefix` is put before every rollout and group id
    (an evaluation's id keeps its rollouts apart from every other's); seeds do not depend on it.
    Before anything is generated, every prompt is checked against the backend's context length
    (`context.fit_prompts`): with `strict_context` (collect, run) a prompt that leaves less than the
    response budget is a ContextError (or is truncated, with `config.truncate_prompts`); without it
    (eval) that is a warning, and generations stop at the context's end.

    Raises CollectionStopped (Interrupted on a Ctrl-C) when the collection ends before every planned
    rollout is written; what was finished before is written first.
    """
    plan = plan_rollouts(tasks, config, chat, skip_rollout_ids, rollout_prefix, backend.context_length,
                         strict_context)
    logger.info("collecting %d rollouts (%d skipped as already stored), schedule %s", plan.total,
                len(tasks) * config.group_size - plan.total, config.schedule)
    rewards = Rewards(reward_fn, reward_file, config.reward_timeout_s)
    setup = CollectionSetup(config, chat, backend.context_length, rewards, backend.policy_version, on_context, toolbox)
    loop = backend.event_loop
    own_loop = loop is None
    if own_loop:
        loop = asyncio.new_event_loop()
    writer = PartWriter(write)
    run = _Run(plan.states, setup, backend, sandbox)
    bar = tqdm(total=plan.total, desc="collect", unit="rollout", disable=not progress)
    stopped: BaseException | None = None
    main = loop.create_task(run.main(bar, writer))
    ctrl_c = _CtrlC(loop, main)
    try:
        with ctrl_c:
            loop.run_until_complete(main)
    except BaseException as error:  # noqa: BLE001 - a Ctrl-C or a stop: written parts are said, then raised
        stopped = error
    finally:
        if ctrl_c.pressed and (stopped is None or isinstance(stopped, asyncio.CancelledError)):
            stopped = KeyboardInterrupt()  # the collection's cancel was the Ctrl-C's
        bar.close()
        with deferred(STOPPING):  # a second Ctrl-C while stopping waits for the stop
            main.cancel()
            loop.run_until_complete(asyncio.gather(main, return_exceptions=True))
            loop.run_until_complete(run.stop())
            for part in run.leftover_parts():  # what finished before the stop is committed too
                writer.put_last(part)
            writer.close()
            if own_loop:
                loop.close()
            rewards.close()
    done = CollectionCounts(writer.rollouts, writer.parts)
    if writer.error is not None and not isinstance(stopped, KeyboardInterrupt):
        raise writer.error  # a write that failed (a full disk) says so itself
    if stopped is not None:
        raise _stopped(stopped, done, plan.total, run) from stopped
    if run.abandoned:
        raise CollectionStopped(f"{len(run.abandoned)} of {plan.total} rollouts were not collected: the backend "
                                f"failed their requests (last: {run.faults.last}); the {done.n_rollouts} others "
                                "are committed, and --resume collects the rest")
    return done


def _stopped(error: BaseException, done: CollectionCounts, total: int, run: _Run) -> BaseException:
    """What a collection that ended early raises: one line of why, what is committed, what to do."""
    committed = f"{done.n_rollouts} of {total} rollouts are committed in {done.n_parts} parts"
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(f"interrupted: {committed}; --resume finishes the collection")
    if isinstance(error, _FaultStop):
        return CollectionStopped(f"{error}; the collection stopped: {committed}, and --resume collects the rest "
                                 "once the backend is back")
    return error  # a tool or reward that broke its contract says so (parts committed stay), a bug is a bug


class _CtrlC:
    """While the collection runs, a Ctrl-C cancels its main task through the loop, which then stops
    as any interrupted collection does.

    The handler is the loop's (`add_signal_handler`), which sets the signal wakeup descriptor: the
    loop wakes however the signal arrives (on the main thread or another, with the main thread asleep
    in the selector), and the handler never runs inside a finalizer, where a KeyboardInterrupt is
    printed and lost. Installed on the main thread only (the only one a SIGINT reaches), and the
    handler that was there before comes back after."""

    def __init__(self, loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> None:
        self.loop, self.main = loop, main
        self.pressed = False
        self.previous = None
        self.installed = False

    def _on_sigint(self) -> None:
        if self.pressed:
            _say_stopping()
            return
        self.pressed = True
        self.main.cancel()

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            self.loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            self.installed = True
        return self

    def __exit__(self, *_) -> None:
        if self.installed:
            self.loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.default_int_handler)
            self.installed = False


def _say_stopping() -> None:
    """What a Ctrl-C says once the collection is stopping already."""
    say_stopping(STOPPING)


# ---------------------------------------------------------------------------------------------
# Writing parts beside the loop


class PartWriter:
    """Finished parts written on a thread of their own, at most MAX_PENDING_PARTS waiting. A write
    that fails settles `failed`, which the schedule waits on beside its rollouts."""

    def __init__(self, write: Callable[[CollectedBatch], None]) -> None:
        self.write = write
        self.rollouts = 0  # written so far
        self.parts = 0
        self.error: BaseException | None = None  # the first write that failed; nothing is written after it
        self.failed: asyncio.Future | None = None  # done once a write failed (on the schedule's loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.Queue = queue.Queue()
        self._slots: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self._drain, name="cleaner-writer", daemon=True)
        self._thread.start()

    def bind(self) -> asyncio.Future:
        """Start handing parts over from the running loop; the future a failed write settles."""
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(MAX_PENDING_PARTS)
        self.failed = self._loop.create_future()
        return self.failed

    async def put(self, part: CollectedBatch) -> None:
        """Hand `part` over; waits (with the rollouts in flight going on) while MAX_PENDING_PARTS wait."""
        await self._slots.acquire()
        if self.error is not None:
            raise self.error
        self._queue.put(part)

    def put_last(self, part: CollectedBatch) -> None:
        """Hand `part` over once the loop has stopped (nothing waits on the slots any more)."""
        self._queue.put(part)

    def _drain(self) -> None:
        while (part := self._queue.get()) is not None:
            try:
                if self.error is None:
                    self.write(part)
                    self.rollouts += len(part.rollouts)
                    self.parts += 1
            except BaseException as error:  # noqa: BLE001 - raised to the schedule, which stops
                self.error = error
                self._call(lambda: self.failed.done() or self.failed.set_result(None))
            finally:
                self._call(self._slots.release)

    def _call(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # a loop closed by a stop waits for nothing more
            self._loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        """Write what was handed over, then end the thread."""
        self._queue.put(None)
        self._thread.join()


# ---------------------------------------------------------------------------------------------
# The run: rollouts in flight, finished ones in parts


class _FaultStop(Exception):  # noqa: N818 - what stopped the collection
    """The share of failed requests reached MAX_FAULT_SHARE."""


class Faults:
    """The outcome of the last FAULT_WINDOW requests (schedule's notes)."""

    def __init__(self) -> None:
        self.window: deque[bool] = deque(maxlen=FAULT_WINDOW)  # True: the request failed
        self.last: str | None = None  # the last failure, in words

    def record(self, failed: bool, what: str = "") -> None:
        self.window.append(failed)
        if failed:
            self.last = what

    def check(self) -> None:
        """_FaultStop when failures are the rule."""
        failed = sum(self.window)
        if failed >= MIN_FAULTS and failed >= MAX_FAULT_SHARE * len(self.window):
            raise _FaultStop(f"{failed} of the last {len(self.window)} requests failed (last: {self.last})")


class _Run:
    """The planned rollouts, those in flight and those finished but not yet handed out."""

    def __init__(self, states: Iterator[RolloutState], setup: CollectionSetup, backend, sandbox) -> None:
        self.setup, self.backend, self.sandbox = setup, backend, sandbox
        self.config = setup.config
        self.waiting = states
        self.exhausted = False  # every planned rollout has started
        self.running: dict[asyncio.Task, RolloutState] = {}
        self.finished: list[tuple[Rollout, RolloutState]] = []
        self.abandoned: list[str] = []  # rollouts an infrastructure fault ended unfinished
        self.faults = Faults()
        self.tokens = TokenCounter()
        self.lock_steps: list[LockstepRequests] = []  # the lock step of the batch in flight
        self.started = time.monotonic()
        self.shown = 0.0

    async def main(self, bar: tqdm, writer: PartWriter) -> None:
        """Run every rollout, handing parts of `batch_rollouts` to the writer as they fill."""
        size = self.config.batch_rollouts
        failed = writer.bind()
        while not self.exhausted or self.running:
            self._start()
            if not self.running:
                continue
            done, _ = await asyncio.wait([*self.running, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                raise writer.error
            broken = [error for task in done if (error := self._finish(task, self.running.pop(task)))]
            bar.update(len(done))
            self._show(bar)
            if broken:
                raise broken[0]  # a tool or reward that broke its contract, or a bug: the collection stops
            self.faults.check()
            while len(self.finished) >= size:
                await writer.put(self._part(size))
                del self.finished[:size]  # only once handed over: a stop meanwhile still finds them
        if self.finished:
            await writer.put(self._part(size))
            self.finished.clear()

    def _finish(self, task: asyncio.Task, state: RolloutState) -> BaseException | None:
        """Keep a finished rollout; an exception that is not an infrastructure fault is returned,
        once every rollout that finished beside it is kept."""
        error = task.exception()
        if isinstance(error, InfraFault):  # not finished: not written, collected again on --resume
            logger.warning("%s; the rollout is not stored (--resume collects it again)", error)
            self.abandoned.append(state.rollout_id)
            return None
        if error is None:
            self.finished.append((task.result(), state))
        return error

    def _part(self, size: int) -> CollectedBatch:
        """The first `size` finished rollouts (plan order within the part), left in `finished`."""
        part = sorted(self.finished[:size], key=lambda pair: pair[1].index)
        return CollectedBatch([rollout for rollout, _ in part], [segment for _, state in part for segment in state.segments])

    def leftover_parts(self) -> list[CollectedBatch]:
        """The rollouts that finished but were not handed over when the collection stopped, in parts."""
        size = self.config.batch_rollouts
        parts = []
        while self.finished:
            parts.append(self._part(size))
            del self.finished[:size]
        return parts

    def _take(self, count: int) -> list[RolloutState]:
        taken = []
        while len(taken) < count and not self.exhausted:
            state = next(self.waiting, None)
            if state is None:
                self.exhausted = True
            else:
                taken.append(state)
        return taken

    def _start(self) -> None:
        """Start rollouts: async, as slots free; lock step, a whole batch once the last one ended."""
        if self.config.schedule == Schedule.LOCKSTEP:
            if self.running:
                return
            batch = self._take(self.config.batch_rollouts)
            requests = LockstepRequests(self.backend, self.sandbox, self.tokens, len(batch), self.setup.toolbox,
                                        self.faults)
            self.lock_steps = [requests]
            for state in batch:
                self._launch(state, requests)
            return
        requests = DirectRequests(self.backend, self.sandbox, self.tokens, self.setup.toolbox, self.faults)
        for state in self._take(self.config.max_concurrent_rollouts - len(self.running)):
            self._launch(state, requests)

    def _launch(self, state: RolloutState, requests: DirectRequests) -> None:
        async def one_rollout() -> Rollout:
            try:
                return await run_rollout(state, self.setup, requests)
            finally:
                requests.leave(state)  # if its rollout did not say so itself (an error)

        self.running[asyncio.get_running_loop().create_task(one_rollout(), name=state.rollout_id)] = state

    def _show(self, bar: tqdm) -> None:
        now = time.monotonic()
        if now - self.shown < PROGRESS_EVERY_S and not self.exhausted:
            return
        self.shown = now
        tools = sum(state.phase == Phase.TOOL for state in self.running.values())
        rate = self.tokens.generated / max(now - self.started, 1e-9)
        faults = f", {len(self.abandoned)} lost to faults" if self.abandoned else ""
        bar.set_postfix_str(f"in flight {len(self.running)} ({tools} in tools), {rate:,.0f} tok/s{faults}",
                            refresh=False)

    async def stop(self) -> None:
        """Cancel what is still running (an interrupted or stopped collection) and close the
        backend's connections on this loop."""
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
    """Each request straight to the backend or the sandbox, as soon as the rollout makes it; each
    outcome counted in `faults`."""

    def __init__(self, backend, sandbox, tokens: TokenCounter, toolbox: Toolbox | None = None,
                 faults: Faults | None = None) -> None:
        self.backend, self.sandbox, self.tokens, self.toolbox = backend, sandbox, tokens, toolbox
        self.faults = faults if faults is not None else Faults()

    async def generate(self, state: RolloutState, context: list[int], params: SamplingParams,
                       seed: int) -> Generation:
        generation = await self._counted(self.backend.generate_async(context, params, seed, session=state.rollout_id))
        self.tokens.generated += len(generation.token_ids)
        return generation

    async def score(self, state: RolloutState, sequences: Sequence[Sequence[int]],
                    starts: Sequence[int]) -> list[list[float]]:
        return await self._counted(self.backend.score_async(sequences, starts, session=state.rollout_id))

    async def _counted(self, request: Awaitable, fault: Callable[[object], str | None] = lambda _: None):
        """`request`'s answer, counted in `faults` as failed if it raises or `fault(answer)` names a fault."""
        try:
            answer = await request
        except Exception as error:
            self.faults.record(True, f"{type(error).__name__}: {error}")
            raise
        why = fault(answer)
        self.faults.record(why is not None, why or "")
        return answer

    async def run_code(self, code: str) -> ExecResult:
        return await self._counted(self.sandbox.run_async(code), lambda result: (
            f"the sandbox: {result.stderr}" if result.status == ToolStatus.INFRA_ERROR else None))

    async def run_tool(self, name: str, arguments: dict, context: CallContext) -> ToolOutcome:
        return await self._counted(self.toolbox.run(name, arguments, context), lambda outcome: (
            f"tool {name}: {outcome.text}" if outcome.status == ToolStatus.INFRA_ERROR else None))

    async def finish_tools(self, state: RolloutState) -> dict[str, object]:
        return {} if self.toolbox is None else await self.toolbox.finish(state.rollout_id)

    def abandon_tools(self, state: RolloutState) -> None:
        if self.toolbox is not None:
            self.toolbox.abandon(state.rollout_id)

    def leave(self, state: RolloutState) -> None:
        """A rollout needs no more turns (nothing to do when nobody waits for it)."""


class LockstepRequests(DirectRequests):
    """A batch's rollouts meet before every generation and every tool round: the requests are held
    until every live rollout of the batch waits in one (tool calls first, then generations), then
    sent together, the generations with the largest limit among them, each cut to its own."""

    def __init__(self, backend, sandbox, tokens: TokenCounter, live: int, toolbox: Toolbox | None = None,
                 faults: Faults | None = None) -> None:
        super().__init__(backend, sandbox, tokens, toolbox, faults)
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

    async def run_tool(self, name: str, arguments: dict, context: CallContext) -> ToolOutcome:
        return await self._hold_call(lambda: DirectRequests.run_tool(self, name, arguments, context))

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
