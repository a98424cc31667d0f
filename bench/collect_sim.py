"""A continuous-batching engine and a tool pool on a simulated clock, driven by the agent loop's own
code (bench/collect_throughput.py --simulate; docs/architecture.md §5).

Nothing sleeps. `VirtualClockLoop` is an asyncio event loop whose clock jumps to the next timer
whenever nothing is ready, so `asyncio.sleep(0.015)` costs no real time; real threads (the loop's
executor) are waited for in real time with the clock standing still, so the agent loop's own CPU
work is free on the simulated clock (its real cost is reported beside).

The engine (`SimEngine`, the Backend's request methods) is modelled on SGLang's scheduler: up to
`max_running` sequences decode together, one token each per step; a step costs
`step_s + per_sequence_s x running + prefill_per_token_s x (uncached prompt tokens admitted)`;
requests beyond `max_running` wait in arrival order. A rollout's previous context and turn stay in
the prefix cache, so a turn prefills only what was added since (its tool response). What a turn
writes is decided by the rollout and the turn's index alone (`Workload`), so every schedule gets the
same requests: lengths lognormal, a call or the answer, a call that fails sometimes. The tools
(`SimSandbox`) take a lognormal time capped at the timeout, `workers` at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field

from cleaner.engine.grading.answers import RewardResult
from cleaner.engine.model.base import LENGTH, STOP, Generation
from cleaner.engine.model.chat import ChatFormat, format_call
from cleaner.sandbox import ExecResult, ExecStatus

# ---------------------------------------------------------------------------------------------
# The clock


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is simulated: when nothing is ready and no thread is working,
    the clock jumps to the next timer instead of waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.threads = 0  # executor jobs in flight (asyncio.to_thread, run_in_executor)
        real_select = self._selector.select

        def select(timeout: float | None):
            events = real_select(0)
            if events or timeout == 0:
                return events
            if self.threads:  # a thread is working: wait for it in real time, the clock stands
                return real_select(0.002 if timeout is None else min(timeout, 0.002))
            if timeout is None:  # nothing scheduled: only real I/O can wake the loop
                return real_select(None)
            self.now += timeout
            return []

        self._selector.select = select

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor, func, *args):
        self.threads += 1
        future = super().run_in_executor(executor, func, *args)

        def done(_) -> None:
            self.threads -= 1

        future.add_done_callback(done)
        return future


# ---------------------------------------------------------------------------------------------
# What each turn writes


def _uniform(*parts: object) -> float:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class Workload:
    """The paper's shape: 1-16 turns per rollout (uniform), turn lengths lognormal around
    `turn_median_tokens`, a quarter of calls failing, tool times lognormal around `tool_median_s`
    up to the timeout."""

    turn_median_tokens: float = 400.0
    turn_sigma: float = 0.8  # of the log length: the 90th percentile is ~2.8x the median
    max_turns: int = 16  # requests per rollout, the last the answer (a failed call's retry counts)
    failure_rate: float = 0.25  # calls that fail (the model retries them)
    tool_median_s: float = 0.5
    tool_sigma: float = 1.0
    tool_timeout_s: float = 4.0

    def turns(self, session: str) -> int:
        return 1 + int(_uniform("turns", session) * self.max_turns)

    def length(self, session: str, turn: int) -> int:
        z = _normal(_uniform("length", session, turn), _uniform("length2", session, turn))
        return max(1, round(self.turn_median_tokens * math.exp(self.turn_sigma * z)))

    def fails(self, session: str, turn: int) -> bool:
        return _uniform("fails", session, turn) < self.failure_rate

    def tool_seconds(self, code: str) -> float:
        z = _normal(_uniform("tool", code), _uniform("tool2", code))
        return min(self.tool_timeout_s, self.tool_median_s * math.exp(self.tool_sigma * z))


def _normal(u1: float, u2: float) -> float:
    """A standard normal from two uniforms (Box-Muller)."""
    return math.sqrt(-2.0 * math.log(max(u1, 1e-300))) * math.cos(2 * math.pi * u2)


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass(frozen=True)
class CostModel:
    """What a decode step costs (the issue's model of an H100 serving a 4B model, plus prefill)."""

    step_s: float = 0.015  # a decode step's fixed cost
    per_sequence_s: float = 0.00005  # plus this per running sequence
    prefill_per_token_s: float = 0.00002  # plus this per uncached prompt token admitted (~50k tok/s)
    max_running: int = 256  # sequences decoding at once; the rest wait


@dataclass(eq=False)
class _Request:
    length: int  # tokens to generate
    prefill: int  # uncached prompt tokens
    generation: Generation
    future: asyncio.Future
    order: int = 0
    arrived: float = 0.0  # when the loop sent it (simulated)


@dataclass
class EngineStats:
    busy_s: float = 0.0  # simulated time spent stepping
    steps: int = 0
    tokens: int = 0  # generated
    sequence_steps: int = 0  # running sequences summed over steps
    requests: int = 0


class SimEngine:
    """The Backend's request methods on a simulated continuous-batching engine (module notes)."""

    policy_version = "simulated@0"
    context_length = None

    def __init__(self, chat: ChatFormat, loop: VirtualClockLoop, workload: Workload | None = None,
                 cost: CostModel | None = None) -> None:
        self.chat, self.loop = chat, loop
        self.workload, self.cost = workload or Workload(), cost or CostModel()
        self.stats = EngineStats()
        self._queue: deque[_Request] = deque()
        self._wake = asyncio.Event()
        self._turn: dict[str, int] = {}
        self._cached: dict[str, int] = {}  # a rollout's context + turn, as the prefix cache holds them
        self._order = itertools.count()
        self._filler = chat.encode(" x")[0]
        self._answer = tuple(chat.encode("So the answer is \\boxed{42}.<|im_end|>"))
        self._server: asyncio.Task | None = None

    @property
    def event_loop(self) -> VirtualClockLoop:
        return self.loop

    async def generate_async(self, prompt, params, seed, session=None) -> Generation:
        if self._server is None:
            self._server = self.loop.create_task(self._serve())
        turn = self._turn.get(session, 0)
        self._turn[session] = turn + 1
        generation = self._write(session, turn, params.max_new_tokens)
        prefill = len(prompt) - min(len(prompt), self._cached.get(session, 0))
        self._cached[session] = len(prompt) + len(generation.token_ids)
        future = self.loop.create_future()
        self._queue.append(_Request(len(generation.token_ids), prefill, generation, future, next(self._order),
                                    self.loop.time()))
        self.stats.requests += 1
        self._wake.set()
        return await future

    async def score_async(self, sequences, starts, session=None):
        return [[-0.5] * (len(s) - p) for s, p in zip(sequences, starts, strict=True)]

    async def close_requests(self) -> None:
        if self._server is not None:
            self._server.cancel()
            self._server = None

    def _write(self, session: str, turn: int, limit: int) -> Generation:
        """The turn's tokens: filler, then a call (of code naming the rollout and turn, failing or
        not) or, on the rollout's last turn, the answer; cut at `limit`."""
        if turn + 1 >= self.workload.turns(session):
            ending = self._answer
        else:
            action = "undefined_name()" if self.workload.fails(session, turn) else "print(1)"
            ending = tuple(self.chat.encode(format_call(f"# {session} {turn}\n{action}")))
        length = max(len(ending), self.workload.length(session, turn))
        ids = (self._filler,) * (length - len(ending)) + ending
        reason = STOP
        if len(ids) > limit:
            ids, reason = ids[:limit], LENGTH
        return Generation(ids, (-0.5,) * len(ids), reason)

    async def _serve(self) -> None:
        """Decode on the engine's own clock: a loop held up (a write on it) delays results and new
        requests, never the steps of the sequences already running, which the engine catches up
        with; a request joins only steps at or after its arrival."""
        running: list[tuple[int, int, _Request]] = []  # (the step it ends on, order, request)
        cost = self.cost
        clock = self.loop.time()
        while True:
            while not running and not self._queue:
                self._wake.clear()
                await self._wake.wait()
            if not running:
                clock = max(clock, self._queue[0].arrived)
            prefill = 0
            while self._queue and len(running) < cost.max_running and self._queue[0].arrived <= clock:
                request = self._queue.popleft()
                prefill += request.prefill
                heapq.heappush(running, (self.stats.steps + request.length, request.order, request))
            seconds = cost.step_s + cost.per_sequence_s * len(running) + cost.prefill_per_token_s * prefill
            clock += seconds
            await asyncio.sleep(max(clock - self.loop.time(), 0.0))
            self.stats.busy_s += seconds
            self.stats.steps += 1
            self.stats.tokens += len(running)
            self.stats.sequence_steps += len(running)
            while running and running[0][0] <= self.stats.steps:
                request = heapq.heappop(running)[2]
                if not request.future.done():
                    request.future.set_result(request.generation)


# ---------------------------------------------------------------------------------------------
# The tools


@dataclass
class SimSandbox:
    """`run_async` on the simulated clock: `workers` calls at once, each taking the workload's time.
    A call whose code names an undefined function fails with a NameError, as the real tool would."""

    workload: Workload
    workers: int = 256
    calls: int = 0
    busy_s: float = 0.0
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    async def run_async(self, code: str, stdin: str | None = None) -> ExecResult:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            seconds = self.workload.tool_seconds(code)
            await asyncio.sleep(seconds)
            self.calls += 1
            self.busy_s += seconds
        if "undefined_name" in code:
            return ExecResult(ExecStatus.ERROR, "NameError", "", "NameError: name 'undefined_name' is not defined",
                              seconds * 1000)
        return ExecResult(ExecStatus.OK, None, "1\n", "", seconds * 1000)


def sim_reward(text: str, ground_truth: str, data_source: str):
    """The answer's reward without a grader (math-verify's real seconds would only slow the run)."""
    correct = "\\boxed{42}" in text
    return RewardResult(float(correct), correct, "42" if correct else None)


def sim_prompt(index: int, words: int = 220) -> str:
    """A problem statement of about 300 tokens (a word of filler per token, roughly)."""
    rng = random.Random(index)
    return f"Problem {index}: " + " ".join(rng.choice(("compute", "the", "sum", "of", "values", "x", "y"))
                                             for _ in range(words))
