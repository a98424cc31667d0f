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
  up the process's exit). It counts as hung until it returns; past `max_hung` at once the next call
  raises `HungCalls`, one line, since a tool or reward that hangs that often is broken.
- `CoroutineCalls` runs coroutine functions on an event loop of their own, on one daemon thread,
  timed there: the collection's loop may be busy rendering a thousand contexts, and that latency
  is not the call's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cleaner.errors import JobError

# A coroutine call is given this long beyond its timeout to come back from the calls' own loop
# before it counts as hung there (a coroutine that blocks that loop with synchronous work).
LOOP_GRACE_S = 5.0


class HungCalls(JobError):
    """Too many calls are still running past their timeouts; the message names what hung."""


@dataclass(frozen=True)
class Timed:
    """A call's outcome by its own clock."""

    value: object = None  # what it returned (None when it raised or timed out)
    error: BaseException | None = None  # what it raised
    seconds: float = 0.0  # its own run, from its start on its thread (or loop) to its end or deadline
    timed_out: bool = False  # it ran past its timeout (given up, or returned late)


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
        with self.calls.lock:
            self.ended_at = time.monotonic()
            if self.abandoned:
                self.calls.hung -= 1
                self.calls.hung_by[self.what] -= 1
        _notify(self.loop, self.done, None)


class ThreadCalls:
    """Synchronous calls on daemon threads, at most `limit` running (module notes)."""

    def __init__(self, limit: int, max_hung: int, name: str) -> None:
        if limit < 1 or max_hung < 0:
            raise ValueError(f"limit must be >= 1 and max_hung >= 0, got {limit}, {max_hung}")
        self.limit, self.max_hung, self.name = limit, max_hung, name
        self.lock = threading.Lock()
        self.hung = 0  # calls given up at their deadline that have not returned yet
        self.hung_by: Counter[str] = Counter()  # the same, by what was called
        self.executor = DaemonThreads(f"{name}-call")
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self.lock:  # the collection's loop and the toolbox's (a release) both ask
            for closed in [other for other in self._slots if other.is_closed()]:
                del self._slots[closed]
            return self._slots.setdefault(loop, asyncio.Semaphore(self.limit))

    async def run(self, fn: Callable, args: tuple, timeout_s: float, what: str) -> Timed:
        """`fn(*args)` on a thread of its own, once a slot is free; `what` names it in HungCalls."""
        with self.lock:
            if self.hung > self.max_hung:
                which = ", ".join(f"{name}: {count}" for name, count in self.hung_by.most_common() if count)
                raise HungCalls(f"{self.hung} calls are still running past their timeouts ({which}; at most "
                                f"{self.max_hung} may hang at once); the collection stops")
        async with self._slot():  # no clock runs while a call waits here
            call = _ThreadCall(fn, args, self, what)
            await call.started
            deadline = call.started_at + timeout_s
            while call.ended_at is None and (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):  # the loop's clock may run ahead of the call's
                    await asyncio.wait_for(asyncio.shield(call.done), left)
            with self.lock:
                if call.ended_at is None:  # still running at its deadline, by its own clock
                    call.abandoned = True
                    self.hung += 1
                    self.hung_by[what] += 1
                    return Timed(seconds=time.monotonic() - call.started_at, timed_out=True)
            seconds = call.ended_at - call.started_at
            if seconds > timeout_s:  # it returned, but after its timeout
                return Timed(seconds=seconds, timed_out=True)
            return Timed(call.value, call.error, seconds)


class CoroutineCalls:
    """Coroutine functions on an event loop of their own (module notes); one daemon thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The calls' loop, started on first use."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"{self.name}-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    async def run(self, make: Callable[[], Awaitable], timeout_s: float) -> Timed:
        """Await `make()` on the calls' loop under `timeout_s`, timed there."""
        async def timed() -> Timed:
            started = time.monotonic()
            try:
                value = await asyncio.wait_for(make(), timeout_s)
            except TimeoutError as error:
                seconds = time.monotonic() - started
                if seconds >= timeout_s:
                    return Timed(seconds=seconds, timed_out=True)
                return Timed(error=error, seconds=seconds)  # the call's own TimeoutError
            except Exception as error:  # noqa: BLE001 - the caller's to judge
                return Timed(error=error, seconds=time.monotonic() - started)
            return Timed(value, None, time.monotonic() - started)

        future = asyncio.run_coroutine_threadsafe(timed(), self.loop())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + LOOP_GRACE_S)
        except TimeoutError:  # the calls' loop is blocked (a coroutine doing synchronous work)
            future.cancel()
            return Timed(seconds=timeout_s + LOOP_GRACE_S, timed_out=True)

    def submit(self, coroutine: Awaitable) -> object:
        """Run `coroutine` on the calls' loop and wait for it here (for set-up and tear-down)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop()).result()

    def close(self) -> None:
        """Stop the calls' loop (what still runs there is dropped with its daemon thread)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
