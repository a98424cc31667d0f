"""A collection at its edges (docs/architecture.md §5, "Faults and load"): what it stores never
depends on how many rollouts are in flight, how slow the disk is or how the user's code misbehaves,
and nothing hangs. Each test injects the load or the fault and compares what was stored."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
import threading
import time

import pytest

from cleaner.config import PurifyConfig
from cleaner.engine.collect.agent import cut_generation
from cleaner.engine.collect.schedule import LockstepRequests, TokenCounter, collect
from cleaner.engine.model.base import LENGTH, STOP, Generation, SamplingParams
from cleaner.engine.model.chat import ChatFormat, format_tool_call
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.tools import HungCalls, Tool, Toolbox, ToolError, ToolResult, ToolUnavailable
from tests.agent_fakes import (
    BASE,
    CHAT,
    CharTokenizer,
    FakeSandbox,
    ScriptedBackend,
    answer,
    collect_parts,
    fake_reward,
    task,
)
from tests.helpers import comparable

# ---------------------------------------------------------------------------------------------
# Load: the user's tools are timed by their own run


class Sleeper(Tool):
    """Works `seconds` (a synchronous call, on a thread), or awaits in `steps` (a coroutine)."""

    name = "work"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def __init__(self, seconds: float, timeout_s: float) -> None:
        super().__init__()
        self.seconds, self.timeout_s = seconds, timeout_s

    def call(self, arguments):
        time.sleep(self.seconds)
        return f"done {arguments['n']}"


class AwaitingSleeper(Sleeper):
    async def call(self, arguments):
        for _ in range(5):
            await asyncio.sleep(self.seconds / 5)
        return f"done {arguments['n']}"


def _tool_rollouts(tool: Tool, prompts: int, **changes):
    """Every prompt's rollout calls `tool` once, then answers: (rollouts, segments) as they compare."""
    box = Toolbox([tool])
    config = dataclasses.replace(BASE, **changes)
    scripts = {(f"p{i}", sample): ["Go." + format_tool_call(tool.name, {"n": i}), answer("42")]
               for i in range(prompts) for sample in range(config.group_size)}
    parts = collect_parts([task(f"p{i}") for i in range(prompts)], config, ScriptedBackend(scripts, config),
                          FakeSandbox(), ChatFormat(CharTokenizer(), box.schemas), reward_fn=fake_reward,
                          progress=False, toolbox=box)
    box.close()
    return comparable([r for p in parts for r in p.rollouts], [s for p in parts for s in p.segments])


def _statuses(segments) -> list[tuple[str, str]]:
    return [(s.rollout_id, s.tool_status) for s in segments if s.kind == "tool"]


def test_a_tools_timeout_measures_its_run_never_its_wait_for_a_thread():
    """96 rollouts call a tool that works 0.2 s under a 0.5 s timeout. At 1,024 in flight, 64 of the
    calls wait for one of the 32 threads (up to 0.4 s): had the wait counted, a third would time
    out. Every call is ok at either concurrency, row for row the same collection."""
    few = _tool_rollouts(Sleeper(0.2, 0.5), 96, max_concurrent_rollouts=8, batch_rollouts=16)
    many = _tool_rollouts(Sleeper(0.2, 0.5), 96, max_concurrent_rollouts=1024, batch_rollouts=16)
    assert set(status for _, status in _statuses(many[1])) == {"ok"} and len(_statuses(many[1])) == 96
    assert many == few


def test_a_call_past_its_timeout_times_out_at_any_concurrency():
    slow = _tool_rollouts(Sleeper(0.3, 0.1), 8, max_concurrent_rollouts=1)
    assert {status for _, status in _statuses(slow[1])} == {"timeout"}
    tool = next(s for s in slow[1] if s.kind == "tool")
    assert tool.text.endswith("Tool call failure\nreason: timeout\nthe call ran past its 0.1 s timeout</tool_response>"
                              "<|im_end|>\n<|im_start|>assistant\n".replace("</tool_response>", "\n</tool_response>"))


def test_a_slow_disk_changes_no_status():
    """Parts written by a writer that takes 0.6 s each (a slow disk): the loop is not held up, so a
    coroutine tool doing five 0.05 s awaits under a 0.5 s timeout is ok, as with instant writes."""
    box = Toolbox([AwaitingSleeper(0.25, 0.5)])
    config = dataclasses.replace(BASE, batch_rollouts=2)
    scripts = {(f"p{i}", 0): ["Go." + format_tool_call("work", {"n": i}), answer("42")] for i in range(12)}
    chat = ChatFormat(CharTokenizer(), box.schemas)

    def run(write_s: float):
        parts = []

        def write(part):
            time.sleep(write_s)
            parts.append(part)

        started = time.monotonic()
        collect([task(f"p{i}") for i in range(12)], config, ScriptedBackend(scripts, config), FakeSandbox(), chat,
                write=write, reward_fn=fake_reward, progress=False, toolbox=box)
        return parts, time.monotonic() - started

    instant, _ = run(0.0)
    slow, seconds = run(0.6)
    box.close()
    rows = comparable([r for p in slow for r in p.rollouts], [s for p in slow for s in p.segments])
    assert rows == comparable([r for p in instant for r in p.rollouts], [s for p in instant for s in p.segments])
    assert {status for _, status in _statuses(rows[1])} == {"ok"}
    assert 6 * 0.6 <= seconds < 6 * 0.6 + 1.5  # the six writes one after the other, the rollouts beside them


def test_the_loop_goes_on_while_a_part_is_written():
    """Parts of one rollout, one rollout in flight: the first write waits (up to 5 s) until the
    backend is asked for the NEXT rollout's turn. The loop asks while the part is being written
    (a writer thread), so the wait ends at once; a write on the loop would hold the next rollout
    back until it returned."""
    config = dataclasses.replace(BASE, batch_rollouts=1, max_concurrent_rollouts=1)
    backend = ScriptedBackend({(f"p{i}", 0): [answer("42")] for i in range(3)}, config)
    asked, next_asked = [], threading.Event()
    honest = backend.generate_async

    async def generate_async(prompt, params, seed, session=None):
        asked.append(session)
        if len(set(asked)) >= 2:
            next_asked.set()
        return await honest(prompt, params, seed, session)

    backend.generate_async = generate_async
    waited = []

    def write(part):
        if not waited:
            waited.append(next_asked.wait(5))

    collect([task(f"p{i}") for i in range(3)], config, backend, FakeSandbox(), CHAT, write=write,
            reward_fn=fake_reward, progress=False)
    assert waited == [True]


def test_a_stop_while_a_finished_part_waits_for_the_writer_commits_it():
    """Parts of one rollout; the disk holds the first write for 2 s, so the writer's slots fill and
    the third finished rollout's part waits for one. A Ctrl-C (raised in the fourth rollout's
    request) stops the collection meanwhile: the waiting part is committed all the same, three
    rollouts in three parts."""
    from cleaner.errors import Interrupted

    config = dataclasses.replace(BASE, batch_rollouts=1, max_concurrent_rollouts=2)
    backend = ScriptedBackend({(f"p{i}", 0): [answer("42")] for i in range(4)}, config)
    honest = backend.generate_async

    async def generate_async(prompt, params, seed, session=None):
        if session == "it0-p3-s0":
            await asyncio.sleep(0.5)  # p2 has finished and its part waits for a slot meanwhile
            raise KeyboardInterrupt
        return await honest(prompt, params, seed, session)

    backend.generate_async = generate_async
    parts = []

    def write(part):
        if not parts:
            time.sleep(2.0)
        parts.append(part)

    with pytest.raises(Interrupted, match=r"^interrupted: 3 of 4 rollouts are committed in 3 parts; --resume"):
        collect([task(f"p{i}") for i in range(4)], config, backend, FakeSandbox(), CHAT, write=write,
                reward_fn=fake_reward, progress=False)
    assert sorted(r.rollout_id for p in parts for r in p.rollouts) == ["it0-p0-s0", "it0-p1-s0", "it0-p2-s0"]


def test_a_ctrl_c_taken_by_another_thread_while_the_loop_sleeps_stops_the_collection_at_once():
    """The kernel hands a process's SIGINT to any thread that does not block it. Here the main thread
    blocks it and sleeps in the loop's selector (the fourth rollout's request waits 10 s) while a
    thread of its own takes the Ctrl-C: the loop wakes on the signal's wakeup descriptor and stops
    within a second, the three finished rollouts committed, instead of sleeping on until the
    request returns. The handler that was there before comes back."""
    import os
    import signal

    from cleaner.errors import Interrupted

    config = dataclasses.replace(BASE, batch_rollouts=1, max_concurrent_rollouts=1)
    backend = ScriptedBackend({(f"p{i}", 0): [answer("42")] for i in range(4)}, config)
    honest = backend.generate_async

    def ctrl_c_on_this_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    async def generate_async(prompt, params, seed, session=None):
        if session == "it0-p3-s0":
            threading.Thread(target=ctrl_c_on_this_thread, daemon=True).start()
            await asyncio.sleep(10.0)
        return await honest(prompt, params, seed, session)

    backend.generate_async = generate_async
    parts = []
    before = signal.getsignal(signal.SIGINT)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    started = time.monotonic()
    try:
        with pytest.raises(Interrupted, match=r"^interrupted: 3 of 4 rollouts are committed in 3 parts; --resume"):
            collect([task(f"p{i}") for i in range(4)], config, backend, FakeSandbox(), CHAT, write=parts.append,
                    reward_fn=fake_reward, progress=False)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGINT) is before
    assert sorted(r.rollout_id for p in parts for r in p.rollouts) == ["it0-p0-s0", "it0-p1-s0", "it0-p2-s0"]


# ---------------------------------------------------------------------------------------------
# Faults of the user's tools


class Hangs(Tool):
    name = "hangs"
    timeout_s = 0.1
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def call(self, arguments):
        self.release.wait()
        return "late"


def test_hung_calls_give_up_their_threads_and_past_the_cap_stop_the_collection(monkeypatch):
    """More calls hang than there are threads (40 against 32): each times out at its deadline and
    frees its slot, so the last 8 run and time out too, and 40 calls of another tool run at once;
    past MAX_HUNG hung calls the next call stops the collection in one line."""
    from cleaner.tools import toolbox as toolbox_module

    release = threading.Event()
    box = Toolbox([Hangs(release), Sleeper(0.0, 1.0)])
    hanging = toolbox_module.THREADS + 8
    monkeypatch.setattr(box.hung, "max_hung", hanging)

    async def main():
        hung = await asyncio.wait_for(asyncio.gather(*[box.run("hangs", {"n": i}) for i in range(hanging)]), 5)
        fine = await asyncio.wait_for(asyncio.gather(*[box.run("work", {"n": i}) for i in range(40)]), 5)
        return hung, fine

    try:
        hung, fine = asyncio.run(main())
        assert {o.status for o in hung} == {"timeout"} and {o.status for o in fine} == {"ok"}
        assert box.hung.count == hanging
        with pytest.raises(HungCalls, match=rf"^{hanging + 1} calls are still running past their timeouts \(tool "
                                            rf"'hangs': {hanging + 1}; at most {hanging} may hang at once\); the "
                                            r"collection stops$"):
            asyncio.run(_hang_one_more(box))
    finally:
        release.set()  # they return at last: no longer counted
    deadline = time.monotonic() + 5
    while box.hung.count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box.hung.count == 0
    assert toolbox_module.MAX_HUNG == 32


async def _hang_one_more(box):
    await box.run("hangs", {"n": 99})  # one more hangs
    await box.run("work", {"n": 0})  # refused: one more hangs than may


def test_a_hung_call_never_holds_up_the_exit():
    """A process whose tool call hangs (past its timeout) exits as soon as its work is done."""
    script = (
        "import asyncio, threading\n"
        "from cleaner.tools import Tool, Toolbox\n"
        "class Hangs(Tool):\n"
        "    name = 'hangs'\n"
        "    timeout_s = 0.1\n"
        "    def call(self, arguments):\n"
        "        threading.Event().wait()\n"
        "print(asyncio.run(Toolbox([Hangs()]).run('hangs', {})).status)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "timeout", done.stderr
    assert time.monotonic() - started < 30


class Blocks(Tool):
    """A coroutine tool that works `seconds` synchronously inside `async def` (`time.sleep`, as
    `requests` or a subprocess would), or, `blocking=False`, awaits them."""

    name = "blocks"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    timeout_s = 1.5  # a call's 1 s is within it; had the wait for its loop counted, the second would not be

    def __init__(self, seconds: float, blocking: bool = True) -> None:
        super().__init__()
        self.seconds, self.blocking = seconds, blocking

    async def call(self, arguments):
        if self.blocking:
            time.sleep(self.seconds)
        else:
            await asyncio.sleep(self.seconds)
        return f"done {arguments['n']}"


def _beside(neighbour: Tool, prompts: int = 9):
    """Every third prompt's rollout calls `neighbour`, the others a healthy coroutine tool (five
    0.05 s awaits under a 0.5 s timeout), all at once: (rollouts, segments) as they compare."""
    box = Toolbox([AwaitingSleeper(0.25, 0.5), neighbour])
    scripts = {(f"p{i}", 0): ["Go." + format_tool_call("blocks" if i % 3 == 0 else "work", {"n": i}), answer("42")]
               for i in range(prompts)}
    try:
        parts = collect_parts([task(f"p{i}") for i in range(prompts)], BASE, ScriptedBackend(scripts, BASE),
                              FakeSandbox(), ChatFormat(CharTokenizer(), box.schemas), reward_fn=fake_reward,
                              progress=False, toolbox=box)
    finally:
        box.close()
    return comparable([r for p in parts for r in p.rollouts], [s for p in parts for s in p.segments])


def test_a_coroutine_tool_that_blocks_its_loop_delays_only_its_own_calls(caplog):
    """Three calls of a tool that sleeps 1 s inside `async def` beside six of a healthy coroutine
    tool: the healthy calls are ok, as beside a neighbour that awaits; the blocking tool's calls
    wait for one another with no clock running, so they are ok too; one warning names it."""
    with caplog.at_level("WARNING", logger="cleaner.tools.calls"):
        blocked = _beside(Blocks(1.0))
    # its loop's, only: a loaded machine may stall another loop's thread past BLOCKED_S
    warnings = [record.getMessage() for record in caplog.records
                if record.levelname == "WARNING" and record.getMessage().startswith("tool 'blocks'")]
    awaited = _beside(Blocks(1.0, blocking=False))
    assert [(s.tool_name, s.tool_status) for s in blocked[1] if s.kind == "tool"] == [
        ("blocks" if i % 3 == 0 else "work", "ok") for i in range(9)]
    assert blocked == awaited
    (warning,) = warnings
    found = re.match(r"tool 'blocks' blocks its event loop \(it did not answer for (\d+\.\d) s\)", warning)
    # 1 s when the heartbeat runs between the blocking calls; up to their 3 s when all three reached
    # the loop in one iteration (asyncio runs a batch of ready callbacks before it looks at timers)
    assert found and 1.0 <= float(found[1]) < 4.0, warning


class Mixed(Tool):
    """A coroutine tool: call 0 awaits five 0.2 s sleeps; the others block their loop 0.5 s each."""

    name = "mixed"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    timeout_s = 1.5

    async def call(self, arguments):
        if arguments["n"] == 0:
            for _ in range(5):
                await asyncio.sleep(0.2)
        else:
            time.sleep(0.5)
        return f"done {arguments['n']}"


def test_a_call_whose_loop_answers_between_its_neighbours_blocks_is_never_given_up(monkeypatch):
    """Call 0 (1 s of its own) waits on its loop while five neighbours block it 0.5 s each, 0.6 s
    apart: its wall time (about 2.3 s) passes its timeout and the grace (1.5 + 0.3 s), but its loop
    ticks between the blocks, so nothing is given up, and every call is ok by its own clock."""
    from cleaner.tools import calls as calls_module
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    monkeypatch.setattr(toolbox_module, "INFRA_TRIES", 1)  # a call given up would show as infra_error
    box = Toolbox([Mixed()])

    async def later(n: int):
        await asyncio.sleep(0.6 * n)
        return await box.run("mixed", {"n": n})

    async def main():
        return await asyncio.gather(*[later(n) for n in range(6)])

    try:
        done = asyncio.run(main())
    finally:
        box.close()
    assert [(outcome.status, outcome.text) for outcome in done] == [("ok", f"done {n}") for n in range(6)]
    assert box.hung.count == 0


class Stuck(Tool):
    """A coroutine tool whose calls, `open` or `close` block its loop until `release` is set."""

    name = "stuck"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}
    timeout_s = 0.2

    def __init__(self, release: threading.Event, where: str = "call") -> None:
        super().__init__()
        self.release, self.where = release, where

    async def call(self, arguments):
        if arguments.get("n") == 1:  # awaits, as a healthy call does
            await asyncio.sleep(0.3)
            return "fine"
        await asyncio.sleep(0.05)  # then blocks
        self.release.wait(30)
        return "late"

    async def open(self):
        if self.where == "open":
            self.release.wait(30)

    async def close(self):
        if self.where == "close":
            self.release.wait(30)


def test_a_loop_blocked_for_good_gives_its_calls_up_as_hung_and_leaves_the_others(monkeypatch):
    """A call blocks its tool's loop past its timeout and the grace: it times out, counted as hung.
    A call of the same tool awaiting beside it (a run of its own of 0.3 s), and its tries after,
    which never start: the service's fault (infra_error), each try counted as hung. A healthy
    tool's call is ok. Past MAX_HUNG the next call stops the collection; once the loop is back,
    nothing is counted as hung."""
    from cleaner.tools import calls as calls_module
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.01)
    release = threading.Event()
    box = Toolbox([Stuck(release), AwaitingSleeper(0.1, 0.5)])

    async def main():
        return await asyncio.gather(box.run("stuck", {"n": 0}), box.run("stuck", {"n": 1}), box.run("work", {"n": 2}))

    try:
        stuck, queued, healthy = asyncio.run(main())
        assert (stuck.status, stuck.error_type) == ("timeout", "TimeoutError")
        assert (queued.status, queued.error_type) == ("infra_error", "ToolUnavailable")
        assert queued.text.startswith("the tool's service failed: LoopBlocked: tool 'stuck''s event loop was blocked")
        assert (healthy.status, healthy.text) == ("ok", "done 2")
        assert box.hung.count == 1 + toolbox_module.INFRA_TRIES and box.hung.by["tool 'stuck'"] == 4
        monkeypatch.setattr(box.hung, "max_hung", 3)
        with pytest.raises(HungCalls, match=r"^4 calls are still running past their timeouts \(tool 'stuck': 4; at most 3"):
            asyncio.run(box.run("work", {"n": 3}))
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while box.hung.count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box.hung.count == 0
    box.close()


def test_open_and_close_are_bounded(monkeypatch, caplog):
    """A tool whose `open` blocks is one line; one whose `close` blocks a warning: neither hangs."""
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(toolbox_module, "OPEN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(toolbox_module, "CLOSE_TIMEOUT_S", 0.3)
    release = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(ToolError, match=r"^tool 'stuck': open\(\) did not return within 0.3 s$"):
            Toolbox([Stuck(release, "open")])
        monkeypatch.setattr(toolbox_module, "OPEN_TIMEOUT_S", 30.0)  # this one's open, on a new loop, must pass
        box = Toolbox([Stuck(release, "close")])
        with caplog.at_level("WARNING", logger="cleaner.tools.toolbox"):
            box.close()
    finally:
        release.set()
    assert time.monotonic() - started < 3
    assert [record.getMessage() for record in caplog.records if record.name == "cleaner.tools.toolbox"] == [
        "tool stuck: closing it failed: TimeoutError(\"tool 'stuck' did not return within 0.3 s\")"]


def test_a_tool_whose_loop_is_blocked_does_not_hold_up_the_close(monkeypatch, caplog):
    """A call blocks its tool's loop for good: the close waits a second for the loop, not the
    tool's whole close timeout (10 s here), and says so in one warning."""
    from cleaner.tools import calls as calls_module
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    monkeypatch.setattr(toolbox_module, "CLOSE_TIMEOUT_S", 10.0)
    release = threading.Event()
    box = Toolbox([Stuck(release)])
    try:
        assert asyncio.run(box.run("stuck", {"n": 0})).status == "timeout"  # its loop is blocked now
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="cleaner.tools.toolbox"):
            box.close()
        closing_s = time.monotonic() - started
    finally:
        release.set()
    assert 0.9 <= closing_s < 3, closing_s
    (warning,) = [record.getMessage() for record in caplog.records if "closing" in record.getMessage()]
    assert re.fullmatch(r"tool stuck: closing it failed: TimeoutError\(\"tool 'stuck''s event loop is blocked \(silent "
                        r"for \d+\.\d s\) and did not come back within 1 s\"\)", warning), warning


class Opens(Tool):
    """A coroutine tool whose `open` succeeds, or raises `error`."""

    parameters = {"type": "object", "properties": {}}

    def __init__(self, name: str, error: Exception | None = None) -> None:
        super().__init__()
        self.name, self.error = name, error

    async def call(self, arguments):
        return "fine"

    async def open(self):
        if self.error is not None:
            raise self.error


def test_a_toolbox_that_fails_to_open_stops_the_loops_it_started():
    """One tool opens on its loop, then the next one's `open` raises: the toolbox is not made, and
    neither tool's loop thread is left running (each failed start would leave one per tool)."""
    with pytest.raises(RuntimeError, match="^judge unreachable$"):
        Toolbox([Opens("opens_first"), Opens("opens_second", RuntimeError("judge unreachable"))])
    names = {"cleaner tool 'opens_first' loop", "cleaner tool 'opens_second' loop"}
    deadline = time.monotonic() + 5
    while {t.name for t in threading.enumerate()} & names and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not {t.name for t in threading.enumerate()} & names


class Flaky(Tool):
    """Its service is down for the first `down` calls."""

    name = "judge"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}

    def __init__(self, down: int, as_result: bool = False) -> None:
        super().__init__()
        self.down, self.as_result, self.calls = down, as_result, 0

    def call(self, arguments):
        self.calls += 1
        if self.calls <= self.down:
            if self.as_result:
                return ToolResult("judge service: 503", infra=True)
            raise ToolUnavailable("judge service: connection refused")
        return "accepted"


@pytest.mark.parametrize("as_result", [False, True])
def test_a_tools_service_fault_is_tried_again_then_infra_error_never_trained(monkeypatch, as_result):
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.01)
    recovers = Flaky(down=2, as_result=as_result)
    assert asyncio.run(Toolbox([recovers]).run("judge", {})).status == "ok" and recovers.calls == 3
    # down for good: stored as infra_error, and the rollout stays out of training (advantage 0)
    rollouts, segments = _tool_rollouts(Flaky(down=10**6, as_result=as_result), 1, group_size=2)
    assert {s.tool_status for s in segments if s.kind == "tool"} == {"infra_error"}
    failed = next(s for s in segments if s.kind == "tool")
    assert failed.error_type == "ToolUnavailable"
    rows, stats = render_iteration(rollouts, segments, PurifyConfig(), CHAT.decode)
    assert stats.n_infra_fault == 2 and {row.advantage for row in rows} == {0.0}


# ---------------------------------------------------------------------------------------------
# Planted bugs the tests must catch


def test_a_generation_is_cut_to_its_limit_from_its_start():
    generation = Generation((5, 6, 7, 8), (-0.1, -0.2, -0.3, -0.4), STOP)
    assert cut_generation(generation, 2) == Generation((5, 6), (-0.1, -0.2), LENGTH)
    assert cut_generation(generation, 4) is generation


def test_lock_step_asks_for_the_largest_limit_and_cuts_each_rollout_to_its_own():
    """Two rollouts meet at a lock step's barrier with limits 50 and 20: one wave of requests, each
    asking for 50, and b keeps the first 20 tokens of what its seed samples."""
    turn = answer("x" * 60)
    backend = ScriptedBackend({("a", 0): [turn], ("b", 0): [turn]}, BASE)
    requests = LockstepRequests(backend, FakeSandbox(), TokenCounter(), live=2)

    async def main():
        wide = requests.generate(_State("a"), [1], SamplingParams(50, ()), _seed(BASE, "a"))
        narrow = requests.generate(_State("b"), [1], SamplingParams(20, ()), _seed(BASE, "b"))
        return await asyncio.gather(wide, narrow)

    wide, narrow = asyncio.run(main())
    assert backend.waves.limits == [{50}]  # one wave, the larger limit for both
    assert wide.token_ids == tuple(CHAT.encode(turn)[:50])
    assert narrow.token_ids == tuple(CHAT.encode(turn)[:20]) and narrow.finish_reason == LENGTH


@dataclasses.dataclass
class _State:
    rollout_id: str


def _seed(config, prompt_id):
    from cleaner.engine.collect.agent import turn_seed

    return turn_seed(config.seed, config.iteration, prompt_id, 0, 0)


def test_a_stopped_collection_cancels_the_requests_it_left_waiting():
    """The writer fails after the first part: every rollout still in flight is cancelled, none is
    left awaiting the backend."""
    waiting, cancelled = [], []

    class Stalls(ScriptedBackend):
        async def generate_async(self, prompt, params, seed, session=None):
            if session != "it0-p0-s0":
                waiting.append(session)
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    cancelled.append(session)
                    raise
            return await super().generate_async(prompt, params, seed, session)

    class Crash(Exception):
        pass

    def write(part):
        raise Crash

    config = dataclasses.replace(BASE, batch_rollouts=1)
    scripts = {(f"p{i}", 0): [answer("42")] for i in range(5)}
    with pytest.raises(Crash):
        collect([task(f"p{i}") for i in range(5)], config, Stalls(scripts, config), FakeSandbox(), CHAT,
                write=write, reward_fn=fake_reward, progress=False)
    assert sorted(waiting) == sorted(cancelled) == [f"it0-p{i}-s0" for i in range(1, 5)]


def test_the_sandboxs_run_async_leaves_the_loop_running():
    """A call that sleeps 0.5 s in the real sandbox: the loop ticks meanwhile (it runs on a thread)."""
    from cleaner.sandbox import SandboxConfig, make_sandbox

    async def main(sandbox):
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        result = await sandbox.run_async("import time; time.sleep(0.5); print('woke')")
        ticker.cancel()
        return result, ticks

    with make_sandbox(SandboxConfig(workers=1, timeout_s=5)) as sandbox:
        result, ticks = asyncio.run(main(sandbox))
    assert result.stdout.strip() == "woke" and ticks >= 20
