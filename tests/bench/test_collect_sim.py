"""bench/collect_sim.py: the simulated clock, engine and tools that bench/collect_throughput.py drives
the agent loop with. The clock must jump (no real sleeping) yet wait for real threads; the engine must
charge what its cost model says; and the loop on it must write the same rollouts whatever the schedule."""

from __future__ import annotations

import asyncio
import time

import pytest
from collect_sim import CostModel, SimEngine, SimSandbox, VirtualClockLoop, Workload
from collect_throughput import simulate
from transformers import AutoTokenizer

from cleaner.config import DEFAULT_POLICY
from cleaner.engine.model.base import SamplingParams
from cleaner.engine.model.chat import ChatFormat


def test_the_clock_jumps_over_sleeps_and_stands_while_a_thread_works():
    loop = VirtualClockLoop()
    try:
        started = time.monotonic()

        async def main():
            await asyncio.sleep(3600)
            before = loop.time()
            await asyncio.to_thread(time.sleep, 0.05)  # real work: the clock does not move
            return before, loop.time()

        before, after = loop.run_until_complete(main())
        assert before == pytest.approx(3600) and after == pytest.approx(3600)
        assert time.monotonic() - started < 5  # an hour simulated in well under a second or two
    finally:
        loop.close()


def test_a_request_alone_costs_its_steps_and_its_prefill():
    loop = VirtualClockLoop()
    chat = ChatFormat(AutoTokenizer.from_pretrained(DEFAULT_POLICY))
    cost = CostModel(step_s=0.01, per_sequence_s=0.001, prefill_per_token_s=0.0001)
    engine = SimEngine(chat, loop, Workload(), cost)
    try:
        async def main():
            generation = await engine.generate_async(list(range(200)), SamplingParams(50, ()), 0, session="r")
            await engine.close_requests()
            return generation

        generation = loop.run_until_complete(main())
        steps = len(generation.token_ids)
        assert steps == 50 or generation.finish_reason == "stop"
        # every step: 10 ms + 1 ms for the one sequence; the first also prefills 200 tokens (20 ms)
        assert loop.time() == pytest.approx(steps * 0.011 + 200 * 0.0001)
        assert engine.stats.tokens == steps and engine.stats.busy_s == pytest.approx(loop.time())
    finally:
        loop.close()


def test_the_tools_take_their_time_on_as_many_workers_as_there_are():
    loop = VirtualClockLoop()
    workload = Workload(tool_median_s=1.0, tool_sigma=0.0)  # every call exactly 1 s
    sandbox = SimSandbox(workload, workers=2)
    try:
        async def main():
            return await asyncio.gather(*[sandbox.run_async(f"print({i})") for i in range(5)])

        results = loop.run_until_complete(main())
        assert loop.time() == pytest.approx(3.0)  # five calls on two workers: three rounds
        assert [r.status for r in results] == ["ok"] * 5
        failed = loop.run_until_complete(sandbox.run_async("undefined_name()"))
        assert (failed.status, failed.error_type) == ("error", "NameError")
    finally:
        loop.close()


def test_the_agent_loop_on_the_simulated_engine_writes_the_same_rollouts_whatever_the_schedule():
    lockstep = simulate("lockstep", 16, None, prompts=2)
    on_its_own = simulate("async", 16, 32, prompts=2)
    assert lockstep.rollouts == on_its_own.rollouts == 32
    assert lockstep.kept_tokens == on_its_own.kept_tokens  # the same turns, scheduled otherwise
    assert lockstep.tool_calls == on_its_own.tool_calls
    assert on_its_own.seconds < lockstep.seconds  # nobody waits for the slowest turn or tool
    assert on_its_own.mean_batch > lockstep.mean_batch

