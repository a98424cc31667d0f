"""The user's code called off a collection's event loop, each call timed by its own clock
(docs/architecture.md §5, "Faults and load").

A collection's event loop runs a thousand rollouts at once; the user's tools and reward functions
are called from it. None of them may stall it, and none may be timed by it: what a call's status is
(ok, or past its timeout) must depend on the call's own run alone, never on how many other calls
wait beside it or how late the loop looks. So:

- `ThreadCalls` runs a synchronous call on a daemon thread of its own, at most `limit` at once. A
  call beyond the limit waits for a slot with no clock running; its clock starts on its thread, when
  it starts, and its outcome is judged from that clock (`Timed`): a call that returned after its
  timeout timed out, however quickly the loop noticed, and one that returned within it did not,
  however late the loop noticed. A call still running at its deadline is given up: its slot goes to
  the next call, and its thread runs on as a daemon (a thread cannot be killed; a daemon never holds
  up the process's exit). It counts as hung (`Hung`) until it returns; past `max_hung` at once the
  next call raises `HungCalls`, one line, since a tool or reward that hangs that often is broken.
- `CoroutineCalls` runs coroutine functions on an event loop of its own, on one daemon thread,
  timed there: the collection's loop may be busy rendering a thousand contexts, and that latency
  is not the call's. The toolbox gives each tool a `CoroutineCalls` of its own (a loop per tool),
  rather than moving a tool's calls elsewhere once its loop stops answering: a coroutine tool's
  state is bound to the loop it was made on (the reference's code judge opens an aiohttp session
  in its constructor, which only that loop may use), so its calls cannot move, while a loop of its
  own keeps a tool that blocks (`time.sleep`, `requests` or a subprocess inside `async def`) from
  delaying any other tool's calls: it delays its own calls only, which run one after the other
  as its blocking makes them.
- A coroutine call's run is timed on its loop as a thread call's is on its thread: from when its
  loop starts it, less the time its loop spent inside other calls' steps meanwhile (each call's
  coroutine is driven step by step, `_Steps`, so the loop knows whose synchronous work it ran).
  Waiting behind a blocking neighbour of the same tool is not its run, at any concurrency; a call
  that blocks past its timeout and then returns timed out by its own clock. The loop's heartbeat
  (a tick every `TICK_S`) tells a busy loop from a stuck one: a tick later than `BLOCKED_S` is
  reported once, in one warning line naming what blocks. Once the loop has given no tick for a
  call's timeout and `LOOP_GRACE_S`, the call is given up: timed out if its own step is what
  blocks the loop, else `LoopBlocked` (the service's fault, never the call's). Either counts as
  hung until its loop gets back to it, so a loop blocked for good stops the collection as hung
  threads do.
- What else is sent to a loop (a tool's `open`, `close`) waits at most its own bound, except on a
  loop known blocked now (a call of its given up and not yet back, or silent past `BLOCKED_S`):
  that one is given `BLOCKED_WAIT_S` to come back, since what it is sent only starts once it does,
  so a tool found blocking its loop does not hold up the exit for its whole close timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cleaner.errors import JobError

logger = logging.getLogger(__name__)

# A coroutine call is given this long beyond its timeout to come back from its loop (or, not yet
# started, for its loop to tick) before it is given up: a loop that long silent is blocked.
LOOP_GRACE_S = 5.0
TICK_S = 0.1  # a coroutine loop's heartbeat
BLOCKED_S = 0.5  # a heartbeat this late means a coroutine ran that long without awaiting: reported
BLOCKED_WAIT_S = 1.0  # what `submit` waits for a loop blocked now to come back, whatever its bound


class HungCalls(JobError):
    """Too many calls are still running past their timeouts; the message names what hung."""


class LoopBlocked(Exception):  # noqa: N818 - names what happened to the call
    """A coroutine call its loop never started: the loop was blocked (module notes)."""


@dataclass(frozen=True)
class Timed:
    """A call's outcome by its own clock."""

    value: object = None  # what it returned (None when it raised or timed out)
    error: BaseException | None = None  # what it raised
    seconds: float = 0.0  # its own run, from its start on its thread (or loop) to its end or deadline
    timed_out: bool = False  # it ran past its timeout (given up, or returned late)


class Hung:
    """Calls given up at their deadline that have not returned yet, by what was called; shared by
    every kind of call of one toolbox (or one collection's rewards)."""

    def __init__(self, max_hung: int) -> None:
        if max_hung < 0:
            raise ValueError(f"max_hung must be >= 0, got {max_hung}")
        self.max_hung = max_hung
        self.lock = threading.Lock()  # also guards each call's start, end and abandonment
        self.count = 0
        self.by: Counter[str] = Counter()

    def check(self) -> None:
        """HungCalls, one line, when more than `max_hung` calls hang."""
        with self.lock:
            if self.count > self.max_hung:
                which = ", ".join(f"{name}: {count}" for name, count in self.by.most_common() if count)
                raise HungCalls(f"{self.count} calls are still running past their timeouts ({which}; at most "
                                f"{self.max_hung} may hang at once); the collection stops")

    def add(self, what: str) -> None:
        """One more hung call of `what` (the caller holds `lock`)."""
        self.count += 1
        self.by[what] += 1

    def remove(self, what: str) -> None:
        """A hung call of `what` returned (the caller holds `lock`)."""
        self.count -= 1
        self.by[what] -= 1


def _settle(future: asyncio.Future, value: object) -> None:
    """Set `future`'s result unless its waiter has given up (cancelled) meanwhile."""
    if not future.done():
        future.set_result(value)


def _notify(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: object) -> None:
    """`_settle` on `loop`, from any thread; a loop that has closed has nobody waiting."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, value)


class DaemonThreads(concurrent.futures.Executor):
    """An executor that runs each call on a daemon thread of its own (one that never holds up the
    exit, unlike a ThreadPoolExecutor's), so the loop's `run_in_executor` knows it is working."""

    def __init__(self, name: str) -> None:
        self.name = name

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - the caller's future carries it
                    future.set_exception(error)

        threading.Thread(target=run, name=self.name, daemon=True).start()
        return future


# ---------------------------------------------------------------------------------------------
# Synchronous calls, a daemon thread each


class _ThreadCall:
    """One call on a daemon thread, recording its own start and end."""

    def __init__(self, fn: Callable, args: tuple, calls: ThreadCalls, what: str) -> None:
        self.fn, self.args, self.calls, self.what = fn, args, calls, what
        loop = asyncio.get_running_loop()
        self.loop, self.started, self.done = loop, loop.create_future(), loop.create_future()
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.value: object = None
        self.error: BaseException | None = None
        self.abandoned = False  # given up at its deadline: counted as hung until it returns
        loop.run_in_executor(calls.executor, self._run)

    def _run(self) -> None:
        self.started_at = time.monotonic()
        _notify(self.loop, self.started, None)
        try:
            self.value = self.fn(*self.args)
        except BaseException as error:  # noqa: BLE001 - the caller's to judge (SystemExit included)
            self.error = error
        with self.calls.hung.lock:
            self.ended_at = time.monotonic()
            if self.abandoned:
                self.calls.hung.remove(self.what)
        _notify(self.loop, self.done, None)


class ThreadCalls:
    """Synchronous calls on daemon threads, at most `limit` running (module notes)."""

    def __init__(self, limit: int, hung: Hung, name: str) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit, self.hung, self.name = limit, hung, name
        self.executor = DaemonThreads(f"{name}-call")
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self._lock = threading.Lock()

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:  # the collection's loop and the toolbox's (a release) both ask
            for closed in [other for other in self._slots if other.is_closed()]:
                del self._slots[closed]
            return self._slots.setdefault(loop, asyncio.Semaphore(self.limit))

    async def run(self, fn: Callable, args: tuple, timeout_s: float, what: str) -> Timed:
        """`fn(*args)` on a thread of its own, once a slot is free; `what` names it in HungCalls."""
        self.hung.check()
        async with self._slot():  # no clock runs while a call waits here
            call = _ThreadCall(fn, args, self, what)
            await call.started
            deadline = call.started_at + timeout_s
            while call.ended_at is None and (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):  # the loop's clock may run ahead of the call's
                    await asyncio.wait_for(asyncio.shield(call.done), left)
            with self.hung.lock:
                if call.ended_at is None:  # still running at its deadline, by its own clock
                    call.abandoned = True
                    self.hung.add(what)
                    return Timed(seconds=time.monotonic() - call.started_at, timed_out=True)
            seconds = call.ended_at - call.started_at
            if seconds > timeout_s:  # it returned, but after its timeout
                return Timed(seconds=seconds, timed_out=True)
            return Timed(call.value, call.error, seconds)


# ---------------------------------------------------------------------------------------------
# Coroutine calls, on a loop of their own


@dataclass
class _LoopCall:
    """One coroutine call as its loop and its waiter both see it (under `Hung.lock`)."""

    started_at: float | None = None
    ended: bool = False
    abandoned: bool = False  # given up by its waiter: counted as hung until its loop gets to it


class _Steps:
    """A call's coroutine awaited step by step, as `await` drives it, the time inside its own steps
    counted in `own` and in its loop's `busy`, and the call marked as its loop's `stepping` meanwhile."""

    def __init__(self, awaitable: Awaitable, calls: CoroutineCalls, call: _LoopCall) -> None:
        self.inner, self.calls, self.call, self.own = awaitable.__await__(), calls, call, 0.0

    def __await__(self):
        send, value = self.inner.send, None
        while True:
            self.calls.stepping, began = self.call, time.monotonic()
            try:
                yielded = send(value)
            except StopIteration as stop:
                return stop.value
            finally:
                spent = time.monotonic() - began
                self.own += spent
                self.calls.busy += spent
                self.calls.stepping = None
            try:
                value, send = (yield yielded), self.inner.send
            except GeneratorExit:
                self.inner.close()
                raise
            except BaseException as error:  # noqa: BLE001 - thrown in by its task (a cancellation): passed on
                value, send = error, self.inner.throw


class CoroutineCalls:
    """Coroutine functions on an event loop of their own (module notes); one daemon thread.
    `what` names them in warnings and in HungCalls ("tool 'lookup'")."""

    def __init__(self, what: str, hung: Hung | None = None) -> None:
        self.what = what
        self.hung = hung if hung is not None else Hung(max_hung=1 << 30)
        self.last_tick = time.monotonic()  # the heartbeat's last tick on the loop
        self.busy = 0.0  # seconds the loop has spent inside its calls' steps (on the loop's thread only)
        self.stepping: _LoopCall | None = None  # the call whose step the loop runs now
        self.reported = False  # the warning that the loop blocks was given
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beating: asyncio.Task | None = None  # the heartbeat, on the loop
        self._ending: set[asyncio.Task] = set()  # calls cancelled and not yet ended (held: the loop holds none)
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The calls' loop, started on first use."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                self._loop, self.last_tick = loop, time.monotonic()
                self._beating = loop.create_task(self._heartbeat())  # before the loop runs: no race
                threading.Thread(target=loop.run_forever, name=f"cleaner {self.what} loop", daemon=True).start()
            return self._loop

    async def _heartbeat(self) -> None:
        while True:
            before = self.last_tick = time.monotonic()
            await asyncio.sleep(TICK_S)
            silent = time.monotonic() - before
            if silent - TICK_S > BLOCKED_S:
                self._blocked(f"it did not answer for {silent:.1f} s")

    def _blocked(self, how: str) -> None:
        with self._lock:
            first, self.reported = not self.reported, True
        if first:
            logger.warning("%s blocks its event loop (%s): its calls wait for one another; blocking work in "
                           "`async def` belongs in `await asyncio.to_thread(...)`, or make it synchronous", self.what, how)

    async def run(self, make: Callable[[], Awaitable], timeout_s: float) -> Timed:
        """Await `make()` on the calls' loop under `timeout_s` of its own run (module notes)."""
        self.hung.check()
        call = _LoopCall()
        future = asyncio.run_coroutine_threadsafe(self._timed(make, timeout_s, call), self.loop())
        waiter = asyncio.wrap_future(future)
        try:
            while True:  # the loop times the call; here, only a loop silent for its timeout and grace
                left = self.last_tick + timeout_s + LOOP_GRACE_S - time.monotonic()
                if left > 0:
                    done, _ = await asyncio.wait({waiter}, timeout=left)
                    if done:
                        return waiter.result()
                    continue
                given_up = self._give_up(call, timeout_s)
                if given_up is None:
                    return await waiter  # it ended just now: its outcome is on its way
                if call.started_at is not None:
                    future.cancel()  # stop awaiting it, once its loop gets back to it
                return given_up  # one never started sees, when its loop gets to it, that it was given up
        except asyncio.CancelledError:
            future.cancel()
            raise

    def _give_up(self, call: _LoopCall, timeout_s: float) -> Timed | None:
        """The call's outcome once its loop has been silent past its timeout and the grace: timed out
        if it is what blocks the loop, else never run (LoopBlocked); None if it just ended."""
        silent = time.monotonic() - self.last_tick
        with self.hung.lock:
            if call.ended:
                return None
            call.abandoned = True
            self.hung.add(self.what)
        self._blocked(f"it did not answer for {silent:.1f} s")
        if self.stepping is call:
            return Timed(seconds=time.monotonic() - call.started_at, timed_out=True)
        return Timed(error=LoopBlocked(f"{self.what}'s event loop was blocked for {silent:.1f} s by another call, "
                                       "past this call's timeout"))

    async def _timed(self, make: Callable[[], Awaitable], timeout_s: float, call: _LoopCall) -> Timed | None:
        """The call on its loop, under `timeout_s` of its own run: its wall time less the time its
        loop spent in other calls' steps meanwhile (a neighbour that blocks is not its run)."""
        with self.hung.lock:
            if call.abandoned:  # given up before its loop got to it: never run
                self.hung.remove(self.what)
                return None
            started = call.started_at = time.monotonic()
        others_before = self.busy
        steps = _Steps(make(), self, call)

        def own() -> float:
            return time.monotonic() - started - (self.busy - others_before - steps.own)

        task = asyncio.ensure_future(_drive(steps))
        try:
            while not task.done() and (left := timeout_s - own()) > 0:
                await asyncio.wait({task}, timeout=left)
            if not task.done():  # cancelled in `finally`; a call that ignores it ends on its own
                return Timed(seconds=own(), timed_out=True)
            if task.cancelled():  # it cancelled itself: not a call's outcome the model made
                return Timed(error=RuntimeError("the call was cancelled from within"), seconds=own())
            seconds, error = own(), task.exception()
            if seconds > timeout_s:  # it blocked its loop past its timeout, then returned
                return Timed(seconds=seconds, timed_out=True)
            if error is not None and not isinstance(error, Exception):
                raise error  # a KeyboardInterrupt, SystemExit: not a call's outcome
            return Timed(error=error, seconds=seconds) if error is not None else Timed(task.result(), None, seconds)
        finally:
            if not task.done():  # past its timeout, or this waiter cancelled: the call goes too
                task.cancel()
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)
            with self.hung.lock:
                call.ended = True
                if call.abandoned:
                    self.hung.remove(self.what)

    def silent_s(self) -> float:
        """How long the calls' loop has been silent past its heartbeat (0 while it ticks, or before
        it starts)."""
        with self._lock:
            running = self._loop is not None and not self._loop.is_closed()
        return max(0.0, time.monotonic() - self.last_tick - TICK_S) if running else 0.0

    def blocked_now(self) -> bool:
        """Whether the loop is known blocked: a call of its given up has not come back, or it has
        been silent past BLOCKED_S."""
        with self.hung.lock:
            given_up = self.hung.by[self.what] > 0
        return given_up or self.silent_s() > BLOCKED_S

    def submit(self, coroutine: Awaitable, timeout_s: float) -> object:
        """Run `coroutine` on the calls' loop and wait for it here, at most `timeout_s` (set-up and
        tear-down), or BLOCKED_WAIT_S if the loop is blocked now (module notes); TimeoutError past
        it, the coroutine cancelled."""
        silent, blocked = self.silent_s(), self.blocked_now()
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop())
        try:
            return future.result(min(timeout_s, BLOCKED_WAIT_S) if blocked else timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            if blocked:
                raise TimeoutError(f"{self.what}'s event loop is blocked (silent for {silent:.1f} s) and did not come "
                                   f"back within {BLOCKED_WAIT_S:g} s") from None
            raise TimeoutError(f"{self.what} did not return within {timeout_s:g} s") from None

    def close(self) -> None:
        """Stop the calls' loop (what still runs there is dropped with its daemon thread)."""
        with self._lock:
            loop, self._loop = self._loop, None
            beating, self._beating = self._beating, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(_stop(beating), loop)


async def _drive(steps: _Steps) -> object:
    return await steps


async def _stop(beating: asyncio.Task | None) -> None:
    """Stop the running loop, its heartbeat (`beating`) ended first."""
    if beating is not None:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
    asyncio.get_running_loop().stop()
