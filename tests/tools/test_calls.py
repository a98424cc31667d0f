"""The user's calls off the collection's loop, each timed by its own clock (cleaner/tools/calls.py;
docs/architecture.md §5, "Faults and load"), tested on `ThreadCalls`, `CoroutineCalls` and `Hung`
themselves: what the toolbox and the rewards build on. Every wait here is bounded (`run`), so a
call that never comes back fails its test instead of hanging the suite."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from cleaner.tools import calls as calls_module
from cleaner.tools.calls import (
    CoroutineCalls,
    DaemonThreads,
    Hung,
    HungCalls,
    LoopBlocked,
    ThreadCalls,
    _LoopCall,
)

BOUND_S = 20.0  # no test here waits longer for anything


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, BOUND_S))


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _threads_named(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name]


# ---------------------------------------------------------------------------------------------
# Hung calls


def test_hung_counts_calls_by_what_and_past_its_cap_names_those_still_hanging():
    with pytest.raises(ValueError, match=r"^max_hung must be >= 0, got -1$"):
        Hung(-1)
    hung = Hung(0)  # none may hang
    hung.check()
    with hung.lock:
        for what in ("tool 'a'", "tool 'a'", "tool 'a'", "tool 'b'", "tool 'c'"):
            hung.add(what)
        hung.remove("tool 'a'")
        hung.remove("tool 'c'")
    assert hung.count == 3 and dict(hung.by) == {"tool 'a'": 2, "tool 'b'": 1, "tool 'c'": 0}
    with pytest.raises(HungCalls, match=r"^3 calls are still running past their timeouts \(tool 'a': 2, tool 'b': 1; "
                                        r"at most 0 may hang at once\); the collection stops$"):
        hung.check()


# ---------------------------------------------------------------------------------------------
# Synchronous calls


def test_daemon_threads_pass_keywords_and_carry_what_a_call_raises():
    threads = DaemonThreads("cleaner-test")
    assert threads.submit(divmod, 7, 2).result(BOUND_S) == (3, 1)
    assert threads.submit(int, "ff", base=16).result(BOUND_S) == 255
    error = threads.submit(int, "zz").exception(BOUND_S)
    assert isinstance(error, ValueError) and str(error) == "invalid literal for int() with base 10: 'zz'"


def test_thread_calls_run_one_at_a_time_at_limit_1_each_on_a_named_daemon_thread():
    with pytest.raises(ValueError, match=r"^limit must be >= 1, got 0$"):
        ThreadCalls(0, Hung(0), "cleaner-test")
    calls = ThreadCalls(1, Hung(0), "cleaner-test")

    def where(seconds: float):
        time.sleep(seconds)
        return threading.current_thread().name, threading.current_thread().daemon

    def fails():
        time.sleep(0.05)
        raise KeyError("k")

    async def main():
        started = time.monotonic()
        both = await asyncio.gather(*(calls.run(where, (0.3,), 5.0, "where") for _ in range(2)))
        return both, time.monotonic() - started, await calls.run(fails, (), 5.0, "fails")

    (first, second), seconds, failed = run(main())
    assert first.value == second.value == ("cleaner-test-call", True)
    assert seconds >= 0.6  # one slot: the second call waited for the first
    assert all(0.3 <= timed.seconds < 5.0 and not timed.timed_out and timed.error is None for timed in (first, second))
    assert failed.value is None and isinstance(failed.error, KeyError) and 0.05 <= failed.seconds < 5.0
    assert not failed.timed_out


@pytest.mark.parametrize(("work_s", "timeout_s", "timed_out"), [(0.2, 0.1, True), (0.05, 0.5, False)],
                         ids=["returned-late", "returned-in-time"])
def test_a_thread_calls_outcome_is_its_own_clocks_however_late_the_loop_looks(work_s, timeout_s, timed_out):
    """The loop is blocked 1 s once the call has started: a call that returned after its timeout
    timed out, one that returned within it did not, whenever the loop noticed."""
    calls = ThreadCalls(2, Hung(0), "cleaner-test")
    started = threading.Event()

    def work():
        started.set()
        time.sleep(work_s)
        return "done"

    async def main():
        call = asyncio.ensure_future(calls.run(work, (), timeout_s, "work"))
        while not started.is_set():
            await asyncio.sleep(0.005)
        time.sleep(1.0)  # the loop looks 1 s late
        return await call

    timed = run(main())
    assert timed.timed_out is timed_out and timed.error is None
    assert timed.value == (None if timed_out else "done")
    assert work_s <= timed.seconds < 1.0


def test_a_thread_call_given_up_frees_its_slot_and_is_hung_until_it_returns_after_its_loop_closed(monkeypatch):
    """A call still running at its deadline times out at it and gives its slot to the next call; it
    counts as hung, by what it is, until it returns, which it does quietly after its loop closed."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    release = threading.Event()
    hung = Hung(1)
    calls = ThreadCalls(1, hung, "cleaner-test-hung")

    def waits():
        release.wait(BOUND_S)
        return "late"

    async def main():
        given_up = await calls.run(waits, (), 0.2, "tool 'waits'")
        return given_up, await calls.run(lambda: "next", (), 5.0, "next")

    try:
        given_up, after = run(main())
        assert given_up.timed_out and given_up.value is None and 0.2 <= given_up.seconds < 1.2
        assert after.value == "next" and not after.timed_out
        assert hung.count == 1 and dict(hung.by) == {"tool 'waits'": 1}
    finally:
        release.set()
    assert wait_until(lambda: not _threads_named("cleaner-test-hung-call"))
    assert hung.count == 0 and dict(hung.by) == {"tool 'waits'": 0}
    assert raised == []  # its loop had closed: nobody to tell, nothing raised


# ---------------------------------------------------------------------------------------------
# Coroutine calls


async def _where():
    await asyncio.sleep(0.1)
    return threading.current_thread().name, threading.current_thread().daemon


async def _blocks_twice():
    """0.6 s of its own, in two steps of 0.3 s that block its loop."""
    time.sleep(0.3)
    await asyncio.sleep(0)
    time.sleep(0.3)
    return "late"


def test_coroutine_calls_run_on_a_named_daemon_loop_each_timed_by_its_own_steps():
    """Two calls that block their loop 0.6 s in two steps each, under a 0.5 s timeout, one after the
    other: each timed out by its own steps' 0.6 s, the first's time never counted in the second's."""
    calls = CoroutineCalls("tool 'x'")
    try:
        where = run(calls.run(_where, 5.0))
        first = run(calls.run(_blocks_twice, 0.5))
        second = run(calls.run(_blocks_twice, 0.5))
    finally:
        calls.close()
    assert where.value == ("cleaner tool 'x' loop", True) and 0.1 <= where.seconds < 5.0 and not where.timed_out
    for timed in (first, second):
        assert timed.timed_out and timed.value is None and timed.error is None and 0.6 <= timed.seconds < 1.6


def test_a_coroutine_call_past_its_timeout_is_cancelled_and_what_one_raises_is_its_error():
    cancelled = threading.Event()

    async def awaits_long():
        try:
            await asyncio.sleep(BOUND_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def cancels_itself():
        await asyncio.sleep(0.05)
        raise asyncio.CancelledError

    async def fails():
        await asyncio.sleep(0.05)
        raise KeyError("k")

    calls = CoroutineCalls("tool 'x'")
    try:
        late = run(calls.run(awaits_long, 0.2))
        assert late.timed_out and late.value is None and 0.2 <= late.seconds < 1.2
        assert cancelled.wait(5.0)  # the call is ended at its timeout, not left running on its loop
        assert wait_until(lambda: not calls._ending)  # and not held once it has ended
        itself = run(calls.run(cancels_itself, 5.0))
        failed = run(calls.run(fails, 5.0))
    finally:
        calls.close()
    assert isinstance(failed.error, KeyError) and failed.value is None and 0.05 <= failed.seconds < 5.0
    assert isinstance(itself.error, RuntimeError) and str(itself.error) == "the call was cancelled from within"
    assert itself.value is None and not itself.timed_out and 0.05 <= itself.seconds < 5.0


WARNING = (r"^tool 'stuck' blocks its event loop \(it did not answer for (\d+\.\d) s\): its calls wait for one another; "
           r"blocking work in `async def` belongs in `await asyncio\.to_thread\(\.\.\.\)`, or make it synchronous$")


def test_a_loop_blocked_for_good_gives_up_its_calls_as_hung_until_it_is_back(monkeypatch, caplog):
    """One call blocks its loop; a second is made while it does, so never starts. Both are given up
    once the loop has been silent for their 0.2 s timeout and the 0.3 s grace: the first timed out
    (its own step blocks), the second LoopBlocked, one warning saying for how long. A loop's own
    calls may hang without a cap (a reward's loop). Once the loop is back, none counts as hung."""
    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    blocking, release = threading.Event(), threading.Event()

    async def blocks():
        await asyncio.sleep(0.05)
        blocking.set()
        release.wait(BOUND_S)
        return "late"

    async def fine():
        return "fine"

    async def main():
        first = asyncio.ensure_future(calls.run(blocks, 0.2))
        await asyncio.to_thread(blocking.wait, BOUND_S)
        return await asyncio.gather(first, calls.run(fine, 0.2))

    calls = CoroutineCalls("tool 'stuck'")
    try:
        with caplog.at_level("WARNING", logger="cleaner.tools.calls"):
            stuck, queued = run(main())
            third = run(calls.run(fine, 0.2))  # no cap refuses it: given up too
        assert stuck.timed_out and stuck.value is None and 0.4 <= stuck.seconds < 2.0
        for given_up in (queued, third):
            assert isinstance(given_up.error, LoopBlocked) and not given_up.timed_out
            found = re.fullmatch(r"tool 'stuck''s event loop was blocked for (\d+\.\d) s by another call, past this "
                                 r"call's timeout", str(given_up.error))
            assert found and 0.5 <= float(found[1]) < 3.0, given_up.error
        assert calls.hung.count == 3 and dict(calls.hung.by) == {"tool 'stuck'": 3}
        (warning,) = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
        assert (found := re.fullmatch(WARNING, warning)) and 0.5 <= float(found[1]) < 3.0, warning
    finally:
        release.set()
    try:
        assert wait_until(lambda: calls.hung.count == 0) and dict(calls.hung.by) == {"tool 'stuck'": 0}
        assert run(calls.run(fine, 5.0)).value == "fine"
    finally:
        calls.close()


def test_a_started_call_given_up_is_ended_as_soon_as_its_loop_is_back(monkeypatch):
    """A call awaiting on its loop when a neighbour blocks that loop is given up (LoopBlocked) after
    its 2 s timeout and the grace; once the loop is back it is cancelled at once, not left to run
    until its own clock, which the neighbour's block never advanced, reaches 2 s."""
    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    started, blocking, release, cancelled = (threading.Event() for _ in range(4))

    async def awaits():
        started.set()
        try:
            await asyncio.sleep(BOUND_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def blocks():
        blocking.set()
        release.wait(BOUND_S)

    async def main():
        awaiting = asyncio.ensure_future(calls.run(awaits, 2.0))
        await asyncio.to_thread(started.wait, BOUND_S)
        blocker = asyncio.ensure_future(calls.run(blocks, 2.0))
        await asyncio.to_thread(blocking.wait, BOUND_S)
        return await asyncio.gather(awaiting, blocker)

    calls = CoroutineCalls("tool 'stuck'")
    try:
        given_up, blocker = run(main())
        assert isinstance(given_up.error, LoopBlocked) and blocker.timed_out
    finally:
        release.set()
    try:
        assert cancelled.wait(1.0)
    finally:
        calls.close()


def test_a_loop_that_ticks_on_time_is_never_reported(monkeypatch, caplog):
    """With a 1.2 s heartbeat a tick is reported only 1.0 s past its time: a call awaiting 2.5 s
    (two ticks on time, each 1.2 s after the last: later than BLOCKED_S, not past it) gives no
    warning. A loaded machine would have to stall the loop's thread a second to warn here."""
    monkeypatch.setattr(calls_module, "TICK_S", 1.2)
    monkeypatch.setattr(calls_module, "BLOCKED_S", 1.0)

    async def awaits():
        await asyncio.sleep(2.5)
        return "done"

    calls = CoroutineCalls("tool 'x'")
    try:
        with caplog.at_level("WARNING", logger="cleaner.tools.calls"):
            assert run(calls.run(awaits, 5.0)).value == "done"
    finally:
        calls.close()
    assert [record.getMessage() for record in caplog.records if record.levelname == "WARNING"] == []


def test_close_ends_the_heartbeat_then_the_loop_and_its_thread():
    calls = CoroutineCalls("tool 'closing'")
    assert run(calls.run(_where, 5.0)).value == ("cleaner tool 'closing' loop", True)
    beating = calls._beating
    calls.close()
    assert wait_until(lambda: not _threads_named("cleaner tool 'closing' loop"))
    assert beating.cancelled()  # ended before its loop stopped, not left pending on a stopped loop


def test_a_call_that_has_ended_is_never_given_up():
    """Its waiter may decide to give up just as the call ends (module notes): the end wins."""
    calls = CoroutineCalls("tool 'x'")
    call = _LoopCall()

    async def done():
        return "done"

    try:
        timed = asyncio.run_coroutine_threadsafe(calls._timed(done, 5.0, call), calls.loop()).result(BOUND_S)
        assert timed.value == "done" and call.ended
        assert calls._give_up(call, 5.0) is None and calls.hung.count == 0
    finally:
        calls.close()


def test_what_is_sent_to_a_loop_blocked_now_waits_a_second_not_its_bound():
    """A loop silent past BLOCKED_S (a coroutine works synchronously there) would start a `close`
    only once it is back: `submit` gives it BLOCKED_WAIT_S, not the 10 s it was given."""
    calls = CoroutineCalls("tool 'slow'")
    blocking, release = threading.Event(), threading.Event()

    async def blocks():
        blocking.set()
        release.wait(BOUND_S)

    asyncio.run_coroutine_threadsafe(blocks(), calls.loop())
    try:
        assert blocking.wait(BOUND_S)
        time.sleep(0.8)  # silent past BLOCKED_S, no call given up
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^tool 'slow''s event loop is blocked \(silent for \d\.\d s\) and did "
                                               r"not come back within 1 s$"):
            calls.submit(asyncio.sleep(0), 10.0)
        assert 0.9 <= time.monotonic() - started < 3
    finally:
        release.set()
        calls.close()
