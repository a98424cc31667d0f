"""The agent loop against a scripted fake backend and a fake sandbox (docs/architecture.md §4, §5, §8).

The fakes (tests/agent_fakes.py) have exactly the interfaces the loop codes against: a
character-level tokenizer wrapped in the real ChatFormat, a backend whose output for a request is
looked up by its seed, and a sandbox whose outcome is read from the code; `waves` records how many
requests arrived together, which is what tells lock step from each rollout on its own clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections import Counter

import pytest

from cleaner.config import PurifyConfig, SaarRollback
from cleaner.engine.collect.agent import CollectedBatch, rollback_draw
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import Task
from cleaner.engine.model.base import SamplingParams
from cleaner.engine.model.chat import ChatFormat, format_call, tool_response_text
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.saar.gate import ScoreCache
from cleaner.engine.saar.walk import RAW, render, view_for
from cleaner.errors import CollectionStopped
from cleaner.tools.responses import format_tool_response, truncated
from tests.agent_fakes import (
    BASE,
    CHAINS,
    CHAT,
    SPECIALS,
    CharTokenizer,
    FakeSandbox,
    ScriptedBackend,
    answer,
    call,
    collect_parts,
    fake_reward,
    fake_score,
    task,
)
from tests.factories import RequestsOverBatch


def run(scripts, config, sandbox=None, raise_on=frozenset(), **kwargs) -> CollectedBatch:
    """Collect every scripted prompt (sample 0 only unless group_size says otherwise); merge parts."""
    prompt_ids = list(dict.fromkeys(prompt_id for prompt_id, _ in scripts))
    backend = ScriptedBackend(scripts, config, raise_on)
    batches = collect_parts([task(p) for p in prompt_ids], config, backend, sandbox or FakeSandbox(),
                            CHAT, reward_fn=fake_reward, progress=False, **kwargs)
    run.backend = backend
    return CollectedBatch([r for b in batches for r in b.rollouts], [s for b in batches for s in b.segments])


def segments_of(batch: CollectedBatch, rollout_id: str):
    return sorted((s for s in batch.segments if s.rollout_id == rollout_id), key=lambda s: s.seq)


EXPECTED_STEPS = {  # (kind, step, attempt, tool_status) of every non-prompt segment
    "shallow": [("assistant", 0, 0, None), ("tool", 0, 0, "error"), ("assistant", 0, 1, None),
                ("tool", 0, 1, "ok"), ("assistant", 1, 0, None)],
    "deep": [("assistant", 0, 0, None), ("tool", 0, 0, "error"), ("assistant", 0, 1, None),
             ("tool", 0, 1, "ok"), ("assistant", 1, 0, None), ("tool", 1, 0, "ok"),
             ("assistant", 2, 0, None)],
    "exhausted": [x for i in range(4) for x in (("assistant", 0, i, None), ("tool", 0, i, "error"))]
    + [("assistant", 1, 0, None), ("tool", 1, 0, "ok"), ("assistant", 2, 0, None)],
    "gives_up": [("assistant", 0, 0, None), ("tool", 0, 0, "error"), ("assistant", 0, 1, None)],
}


def collect_chains(config):
    contexts: dict[str, list[list[int]]] = {}
    batch = run(CHAINS, config, on_context=lambda rid, ctx: contexts.setdefault(rid, []).append(ctx))
    return batch, contexts


@pytest.mark.parametrize("collect_view", ["purified", "raw"])
def test_render_of_stored_segments_reproduces_every_context(collect_view):
    config = dataclasses.replace(BASE, collect_view=collect_view)
    batch, contexts = collect_chains(config)
    n_purified_differs = 0
    for rollout in batch.rollouts:
        segments = segments_of(batch, rollout.rollout_id)
        view = view_for(rollout.rollback_draw, collect_view == "purified", config)
        assistants = [s for s in segments if s.kind == "assistant"]
        assert len(contexts[rollout.rollout_id]) == len(assistants)
        for context, assistant in zip(contexts[rollout.rollout_id], assistants, strict=True):
            before = segments[: assistant.seq]
            assert context == list(render(before, view, CHAT.decode).token_ids)
            raw = [t for s in before for t in s.token_ids]
            if collect_view == "raw":
                assert context == raw
            n_purified_differs += context != raw
        assert rollout.collect_view == collect_view
    # Purified differs from raw once a chain holds 2+ attempts: shallow turn 2, deep turns 2-3,
    # exhausted turns 2-5; gives_up only ever retries once (merged(a_0) + t_0 is raw).
    assert n_purified_differs == (0 if collect_view == "raw" else 1 + 2 + 4 + 0)


def _gated_contexts_hold(config) -> int:
    """Collect CHAINS with the IS gate; every context must be re-rendered by purify at the collect
    config with the same old policy. Returns the merges the gate rejected."""
    batch, contexts = collect_chains(config)
    gated = 0
    for rollout in batch.rollouts:
        segments = segments_of(batch, rollout.rollout_id)
        view = view_for(rollout.rollback_draw, True, config)
        assistants = [s for s in segments if s.kind == "assistant"]
        for context, assistant in zip(contexts[rollout.rollout_id], assistants, strict=True):
            cache = ScoreCache()
            while (rendered := render(segments[: assistant.seq], view, CHAT.decode, oracle=cache)).provisional:
                cache.fill(fake_score)
            assert context == list(rendered.token_ids)
        cache = ScoreCache()
        while (rendered := render(segments, view, CHAT.decode, oracle=cache)).provisional:
            cache.fill(fake_score)
        gated += rendered.stats.n_gated
    return gated


def test_is_gated_collection_is_reproduced_by_purify_at_the_collect_config():
    # Under fake_score the merges' log IS are 19.2 (shallow chain), 19.6 (deep), 20.7 (exhausted):
    # tau = e^20 rejects the first two. A rejection stops its chain, so 3 is the most there can be.
    middle = math.exp(20.0)
    counts = {tau: _gated_contexts_hold(dataclasses.replace(BASE, rollback_is_threshold=tau))
              for tau in (1e-9, middle, 1e12)}
    assert (counts[1e-9], counts[middle], counts[1e12]) == (0, 2, 3)
    assert run.backend.scored  # the backend scored the retries during collection


def test_purified_contexts_by_hand():
    batch, contexts = collect_chains(BASE)
    prompt = "<|im_start|>user\nQuestion shallow?<|im_end|>\n<|im_start|>assistant\n"
    ok = tool_response_text(format_tool_response(True, "print(6*7)", ""))
    # Shallow: the answer sees the first attempt's reasoning with the fixed call, no error.
    expected = prompt + "Let me compute." + format_call("print(6*7)") + ok
    assert contexts["it0-shallow-s0"][2] == CHAT.encode(expected)
    # Deep: the whole failed turn is replaced by the second attempt.
    prompt = prompt.replace("shallow", "deep")
    ok = tool_response_text(format_tool_response(True, "print(42)", ""))
    assert contexts["it0-deep-s0"][2] == CHAT.encode(prompt + call("New plan.", "print(42)") + ok)
    # Exhausted chain in progress: the 4th attempt sees merged(a_0..a_2) + the last error only.
    shallow_merged = "Try 0." + format_call("print(oops2)")  # print(oopsI) are all similar
    error = "NameError: name 'oops' is not defined"
    t2 = tool_response_text(format_tool_response(False, "", error, "error"))
    prompt = prompt.replace("deep", "exhausted")
    assert contexts["it0-exhausted-s0"][3] == CHAT.encode(prompt + shallow_merged + t2)


def test_step_attempt_numbering_and_finish():
    batch = run(CHAINS, BASE)
    for name, expected in EXPECTED_STEPS.items():
        segments = segments_of(batch, f"it0-{name}-s0")
        assert (segments[0].kind, segments[0].seq, segments[0].step, segments[0].attempt) == (
            "prompt", 0, None, None)
        got = [(s.kind, s.step, s.attempt, s.tool_status) for s in segments[1:]]
        assert got == expected, name
        assert [s.seq for s in segments] == list(range(len(segments)))
    rollouts = {r.prompt_id: r for r in batch.rollouts}
    assert {p: r.finish_reason for p, r in rollouts.items()} == dict.fromkeys(rollouts, "answer")
    assert (rollouts["exhausted"].n_assistant_segments, rollouts["exhausted"].n_tool_calls,
            rollouts["exhausted"].n_failed_calls) == (6, 5, 4)
    assert [rollouts[p].correct for p in ("shallow", "deep", "exhausted", "gives_up")] == [
        True, True, True, False]
    assert rollouts["gives_up"].reward == 0.0 and rollouts["shallow"].answer == "42"


def test_segment_fields():
    batch = run({("shallow", 0): CHAINS[("shallow", 0)]}, BASE)
    first, tool = segments_of(batch, "it0-shallow-s0")[1:3]
    assert first.text == call("Let me compute.", "print(6*7+oops)")
    assert first.token_ids == tuple(CHAT.encode(first.text))
    assert first.logprobs == tuple(-(k + 1) / 100 for k in range(len(first.token_ids)))
    assert first.call_start == len("Let me compute.") and first.tool_code == "print(6*7+oops)"
    assert (tool.tool_code, tool.error_type, tool.exec_ms, tool.logprobs) == (
        "print(6*7+oops)", "NameError", 1.5, None)
    assert tool.text == CHAT.decode(tool.token_ids) and "Tool call failure" in tool.text
    rollout = batch.rollouts[0]
    assert rollout.policy_version == "fake-policy@1" and rollout.collect_config_id == BASE.config_id
    assert rollout.rollback_draw == rollback_draw(BASE.seed, 0, "shallow", 0)


def test_lock_step_sends_one_wave_of_requests_per_turn():
    sandbox = FakeSandbox()
    run(CHAINS, dataclasses.replace(BASE, schedule="lockstep"), sandbox=sandbox)
    assert run.backend.waves.sizes == [4, 4, 3, 2, 1, 1]  # active rollouts per turn
    assert sandbox.waves.sizes == [4, 3, 2, 1, 1]


class GatedSandbox(FakeSandbox):
    """`print('slow')` returns only once the rollout `fast` has ended (its answer generated)."""

    def __init__(self, backend_ready: asyncio.Event):
        super().__init__()
        self.fast_done = backend_ready

    async def run_async(self, code, stdin=None):
        if code == "print('slow')":
            await asyncio.wait_for(self.fast_done.wait(), timeout=10)
        return await super().run_async(code, stdin)


def test_a_rollout_never_waits_for_another_ones_tool():
    # In lock step `fast` could not take its second turn before `slow`'s call returns; on its own
    # clock it answers while that call is still running, which is what lets the call return.
    scripts = {("slow", 0): [call("A.", "print('slow')"), answer("42")],
               ("fast", 0): [call("A.", "print(1)"), call("B.", "print(2)"), answer("42")]}
    fast_answered = asyncio.Event()

    def on_context(rollout_id, context):
        if rollout_id == "it0-fast-s0" and context.count(SPECIALS.index("</tool_response>")) == 2:
            fast_answered.set()  # fast's third turn (its answer) is being generated

    batch = run(scripts, BASE, sandbox=GatedSandbox(fast_answered), on_context=on_context)
    assert {r.prompt_id: r.finish_reason for r in batch.rollouts} == {"slow": "answer", "fast": "answer"}
    assert [s.tool_status for s in batch.segments if s.kind == "tool"] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------
# Ends


def test_max_turns_leaves_the_last_call_unexecuted():
    config = dataclasses.replace(BASE, max_turns=2)
    batch = run({("loop", 0): [call("A.", "print(1)"), call("B.", "print(2)")]}, config)
    kinds = [(s.kind, s.tool_status) for s in segments_of(batch, "it0-loop-s0")]
    assert kinds == [("prompt", None), ("assistant", None), ("tool", "ok"), ("assistant", None)]
    assert batch.rollouts[0].finish_reason == "max_turns"
    assert batch.rollouts[0].n_tool_calls == 1


def test_retries_do_not_use_up_max_turns():
    # Three steps allowed: step 0 takes four attempts (three retries), step 1 is the answer.
    config = dataclasses.replace(BASE, max_turns=3)
    script = [call(f"Try {i}.", f"print(oops{i})") for i in range(3)] + [call("Ok.", "print(42)"),
                                                                         answer("42.")]
    batch = run({("retry", 0): script}, config)
    segments = segments_of(batch, "it0-retry-s0")
    assert [(s.kind, s.step, s.attempt) for s in segments if s.kind == "assistant"] == [
        ("assistant", 0, 0), ("assistant", 0, 1), ("assistant", 0, 2), ("assistant", 0, 3),
        ("assistant", 1, 0)]
    assert batch.rollouts[0].finish_reason == "answer" and batch.rollouts[0].correct
    # A fourth step would open past max_turns: its call is not run.
    script = [call("A.", "print(oops)"), call("B.", "print(1)"), call("C.", "print(2)"),
              call("D.", "print(3)")]
    batch = run({("over", 0): script}, config)
    segments = segments_of(batch, "it0-over-s0")
    assert [(s.kind, s.step, s.attempt, s.tool_status) for s in segments[1:]] == [
        ("assistant", 0, 0, None), ("tool", 0, 0, "error"), ("assistant", 0, 1, None),
        ("tool", 0, 1, "ok"), ("assistant", 1, 0, None), ("tool", 1, 0, "ok"),
        ("assistant", 2, 0, None)]
    assert batch.rollouts[0].finish_reason == "max_turns"


def test_a_failure_at_the_last_executable_step_ends_the_rollout():
    # max_turns 2: step 0's call runs, but its retry would be the reference's turn 2: no room.
    config = dataclasses.replace(BASE, max_turns=2)
    batch = run({("late", 0): [call("A.", "print(oops)"), call("B.", "print(42)")]}, config)
    segments = segments_of(batch, "it0-late-s0")
    assert [(s.kind, s.tool_status) for s in segments[1:]] == [("assistant", None), ("tool", "error")]
    assert batch.rollouts[0].finish_reason == "max_turns"


NOTE_3 = ("\n\nNote: This approach has been attempted 3 times with the same type of error. "
          "Consider trying a different algorithm, method, or approach to solve this problem.")


@pytest.mark.parametrize(("max_retries", "note"), [
    (0, None), (1, None), (2, NOTE_3.replace("3 times", "2 times")), (3, NOTE_3)])
def test_the_reference_note_follows_two_or_more_failed_retries(max_retries, note):
    config = dataclasses.replace(BASE, max_retries=max_retries)
    script = [call(f"Try {i}.", f"print(oops{i})") for i in range(max_retries + 1)] + [answer("41.")]
    batch = run({("stuck", 0): script}, config)
    tools = [s for s in segments_of(batch, "it0-stuck-s0") if s.kind == "tool"]
    assert len(tools) == max_retries + 1
    error = format_tool_response(False, "", "NameError: name 'oops' is not defined", "error")
    for tool in tools[:-1]:
        assert tool.text == tool_response_text(error)
    assert tools[-1].text == tool_response_text(error + (note or ""))
    assert tools[-1].token_ids == tuple(CHAT.encode(tools[-1].text))


def test_no_note_when_the_last_retry_succeeds():
    script = [call(f"Try {i}.", f"print(oops{i})") for i in range(3)] + [call("Ok.", "print(42)"),
                                                                         answer("42.")]
    batch = run({("late", 0): script}, BASE)
    assert not any("Note:" in s.text for s in batch.segments if s.kind == "tool")


def test_length_without_call_is_max_tokens():
    config = dataclasses.replace(BASE, max_new_tokens=10, max_response_tokens=100)
    batch = run({("long", 0): ["x" * 50]}, config)
    (assistant,) = [s for s in batch.segments if s.kind == "assistant"]
    assert len(assistant.token_ids) == 10 and batch.rollouts[0].finish_reason == "max_tokens"


def test_response_budget_cuts_the_turn_then_ends():
    config = dataclasses.replace(BASE, max_new_tokens=80, max_response_tokens=150)
    batch = run({("budget", 0): [call("", "print(1)"), "y" * 200], ("short", 0): [answer("42")]},
                config)
    segments = segments_of(batch, "it0-budget-s0")
    used = len(segments[1].token_ids) + len(segments[2].token_ids)  # the call and its response
    assert 0 < 150 - used < 80  # so the second turn is limited by the budget, not max_new_tokens
    assert len(segments[3].token_ids) == 150 - used
    assert run.backend.waves.limits == [{80}, {150 - used}]  # each rollout asks for its own limit
    assert batch.rollouts[0].finish_reason == "max_tokens"


# ---------------------------------------------------------------------------------------------
# Seeds and resume


class RandomBackend(RequestsOverBatch):
    """Samples one of a few turns from random.Random(seed): the output depends on the seed only.
    With `jitter`, every answer comes after a random delay, so rollouts finish in a shuffled order."""

    policy_version = "random@1"
    context_length = None

    def __init__(self, jitter: random.Random | None = None):
        self.jitter = jitter
        self.in_flight = self.most_in_flight = 0

    async def generate_async(self, prompt, params, seed, session=None):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.jitter is not None:
            await asyncio.sleep(self.jitter.random() * 0.003)
        self.in_flight -= 1
        return await super().generate_async(prompt, params, seed, session)

    def generate(self, prompts, params, seeds):
        turns = [call("T.", "print(oops)"), call("T.", "print(1)"), answer("42"), answer("7")]
        return [ScriptedBackend._one(random.Random(seed).choice(turns), params) for seed in seeds]


def collect_random(config, skip=frozenset(), jitter=None, prompts=3):
    """Parts, then the rollouts and segments sorted by rollout (plan order: the ids sort so)."""
    tasks = [task(f"p{i}") for i in range(prompts)]
    backend = RandomBackend(jitter)
    batches = collect_parts(tasks, config, backend, FakeSandbox(), CHAT, reward_fn=fake_reward,
                            skip_rollout_ids=skip, progress=False)
    collect_random.backend = backend
    rollouts = sorted((dataclasses.replace(r, created_at=None) for b in batches for r in b.rollouts),
                      key=lambda r: r.rollout_id)
    segments = sorted((s for b in batches for s in b.segments), key=lambda s: (s.rollout_id, s.seq))
    return batches, rollouts, segments


def test_same_seed_same_records_and_resume():
    config = dataclasses.replace(BASE, group_size=4, batch_rollouts=5, rollback_prob=0.5)
    batches, rollouts, segments = collect_random(config)
    assert [len(b.rollouts) for b in batches] == [5, 5, 2]
    assert [r.rollout_id for r in rollouts] == [f"it0-p{p}-s{i}" for p in range(3) for i in range(4)]
    assert {r.group_id for r in rollouts} == {"it0-p0", "it0-p1", "it0-p2"}
    assert len({r.n_assistant_segments for r in rollouts}) > 1  # the samples really differ
    assert {r.collect_view for r in rollouts} == {"raw", "purified"}  # u < p = 0.5 for some only
    assert all((r.collect_view == "purified") == (r.rollback_draw < 0.5) for r in rollouts)
    _, again, again_segments = collect_random(config)
    assert again == rollouts and again_segments == segments
    _, other, _ = collect_random(dataclasses.replace(config, seed=1))
    assert [r.rollback_draw for r in other] != [r.rollback_draw for r in rollouts]
    done = frozenset(r.rollout_id for r in batches[0].rollouts + batches[1].rollouts[:2])
    resumed_batches, resumed, resumed_segments = collect_random(config, skip=done)
    assert [len(b.rollouts) for b in resumed_batches] == [5]
    assert resumed == [r for r in rollouts if r.rollout_id not in done]
    assert resumed_segments == [s for s in segments if s.rollout_id not in done]


def test_a_part_holds_its_rollouts_in_plan_order():
    config = dataclasses.replace(BASE, group_size=4, batch_rollouts=5)
    batches, _, _ = collect_random(config, jitter=random.Random(1), prompts=4)
    for batch in batches:
        assert [r.rollout_id for r in batch.rollouts] == sorted(r.rollout_id for r in batch.rollouts)
        ids = list(dict.fromkeys(s.rollout_id for s in batch.segments))
        assert ids == [r.rollout_id for r in batch.rollouts]


@pytest.mark.parametrize(("schedule", "batch_rollouts", "max_concurrent", "jitter", "resume_after"), [
    ("async", 64, 1024, None, 0),
    ("async", 3, 1024, 1, 0),  # parts of 3, in a shuffled finishing order
    ("async", 7, 5, 2, 0),  # five in flight at most
    ("async", 4, 2, 3, 9),  # two in flight, resumed after 9 stored rollouts
    ("lockstep", 5, 1024, 4, 0),
    ("lockstep", 6, 1024, None, 12),
])
def test_the_schedule_never_changes_what_a_rollout_contains(schedule, batch_rollouts, max_concurrent, jitter,
                                                            resume_after):
    reference = dataclasses.replace(BASE, group_size=6, rollback_prob=0.5, schedule="lockstep", batch_rollouts=64)
    _, expected, expected_segments = collect_random(reference, prompts=5)
    config = dataclasses.replace(reference, schedule=schedule, batch_rollouts=batch_rollouts,
                                 max_concurrent_rollouts=max_concurrent)
    jitter = None if jitter is None else random.Random(jitter)
    first, _, _ = collect_random(config, jitter=jitter, prompts=5)
    stored = [r.rollout_id for b in first for r in b.rollouts][:resume_after]  # as committed, in parts
    batches, got, got_segments = collect_random(config, skip=frozenset(stored), jitter=jitter, prompts=5)
    assert all(len(b.rollouts) == batch_rollouts for b in batches[:-1])
    assert [r for r in got if r.rollout_id not in stored] == [r for r in expected if r.rollout_id not in stored]
    assert got_segments == [s for s in expected_segments if s.rollout_id not in stored]
    assert len(got) == 30 - len(stored)
    if schedule == "async" and jitter is not None:  # without jitter no request waits: none overlap
        assert collect_random.backend.most_in_flight == min(max_concurrent, 30 - len(stored))


def test_thousands_of_rollouts_in_flight():
    config = dataclasses.replace(BASE, group_size=500, batch_rollouts=256, max_concurrent_rollouts=2000)
    batches, rollouts, segments = collect_random(config, jitter=random.Random(5), prompts=4)
    assert collect_random.backend.most_in_flight == 2000
    assert [len(b.rollouts) for b in batches] == [256] * 7 + [208]
    assert len({r.rollout_id for r in rollouts}) == 2000
    assert {s.rollout_id for s in segments} == {r.rollout_id for r in rollouts}


def test_a_stopped_lock_step_releases_nothing_more():
    """Cancelled stories leave the barrier as they end; a stopping collection must not let that
    release the turns the others were holding."""
    from cleaner.engine.collect.schedule import LockstepRequests, TokenCounter

    backend = RandomBackend()
    sent = []
    backend.generate = lambda prompts, params, seeds: sent.extend(seeds) or []
    requests = LockstepRequests(backend, FakeSandbox(), TokenCounter(), live=3)
    states = [type("State", (), {"rollout_id": f"r{i}"})() for i in range(3)]
    params = SamplingParams(4, ())

    async def main():
        waiting = [asyncio.create_task(requests.generate(state, [1], params, index))
                   for index, state in enumerate(states[:2])]  # the third has not come yet
        await asyncio.sleep(0)
        requests.closed = True
        for waiter, state in zip(waiting, states, strict=False):
            waiter.cancel()
            requests.leave(state)
        requests.leave(states[2])  # all three gone: would release the two held turns if not closed
        await asyncio.gather(*waiting, return_exceptions=True)
        return requests.sent

    assert asyncio.run(main()) == set() and sent == []


@pytest.mark.parametrize("data_source", ["toy", "livecodebench"])
def test_a_reward_never_runs_on_the_loops_thread(data_source):
    """The loop goes on while rewards are computed: a reward handed in runs on a thread of its own
    (the built-in grader's math runs in a reward worker process: test_runner.py)."""
    import threading

    threads = []

    def reward(text, ground_truth, source):
        threads.append(threading.current_thread())
        return fake_reward(text, ground_truth, source)

    scripts = {("main", 0): [answer("42")]}
    tasks = [Task("main", ({"role": "user", "content": "Q?"},), "42", data_source)]
    collect_parts(tasks, BASE, ScriptedBackend(scripts, BASE), FakeSandbox(), CHAT, reward_fn=reward, progress=False)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


# ---------------------------------------------------------------------------------------------
# Faults


def collect_stopped(scripts, config, raise_on, message: str) -> CollectedBatch:
    """What a collection whose backend fails the requests `raise_on` wrote before it said `message`."""
    parts = []
    tasks = [task(p) for p in dict.fromkeys(prompt_id for prompt_id, _ in scripts)]
    with pytest.raises(CollectionStopped) as stopped:
        collect(tasks, config, ScriptedBackend(scripts, config, raise_on), FakeSandbox(), CHAT, write=parts.append,
                reward_fn=fake_reward, progress=False)
    assert str(stopped.value) == message
    return CollectedBatch([r for p in parts for r in p.rollouts], [s for p in parts for s in p.segments])


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_a_backend_fault_leaves_its_rollout_unstored_and_no_other(schedule):
    """c's second turn fails: c is not a finished rollout, so it is not written (--resume collects it
    again), and the collection says so after writing the others; d shares c's lock-step batch and
    still answers."""
    config = dataclasses.replace(BASE, batch_rollouts=2, schedule=schedule)
    scripts = {(p, 0): [call("A.", "print(1)"), answer("42")] for p in ("a", "b", "c", "d")}
    batch = collect_stopped(scripts, config, {("c", 0, 1)}, (
        "1 of 4 rollouts were not collected: the backend failed their requests (last: RuntimeError: CUDA error: "
        "device-side assert triggered); the 3 others are committed, and --resume collects the rest"))
    assert {r.prompt_id: (r.finish_reason, r.reward) for r in batch.rollouts} == {
        "a": ("answer", 1.0), "b": ("answer", 1.0), "d": ("answer", 1.0)}
    assert {s.rollout_id for s in batch.segments} == {"it0-a-s0", "it0-b-s0", "it0-d-s0"}
    # resumed with the fault gone, c is collected as if nothing had happened
    resumed = run(scripts, config, skip_rollout_ids=frozenset(r.rollout_id for r in batch.rollouts))
    healthy = run(scripts, config)
    unstamped = [dataclasses.replace(r, created_at=None) for r in resumed.rollouts]  # the clock may tick between
    assert unstamped == [dataclasses.replace(r, created_at=None) for r in healthy.rollouts if r.prompt_id == "c"]


def test_faults_as_the_rule_stop_the_collection_with_what_is_committed():
    """Every generation of all but the first two prompts fails: once MIN_FAULTS of the window's
    requests (and half of them) have failed, the collection stops, the parts before stay."""
    from cleaner.engine.collect.schedule import MIN_FAULTS

    config = dataclasses.replace(BASE, batch_rollouts=1, max_concurrent_rollouts=1)
    scripts = {(f"p{i}", 0): [answer("42")] for i in range(40)}
    broken = {(f"p{i}", 0, 0) for i in range(2, 40)}
    batch = collect_stopped(scripts, config, broken, (
        f"{MIN_FAULTS} of the last {MIN_FAULTS + 2} requests failed (last: RuntimeError: CUDA error: device-side "
        "assert triggered); the collection stopped: 2 of 40 rollouts are committed in 2 parts, and --resume collects "
        "the rest once the backend is back"))
    assert [r.prompt_id for r in batch.rollouts] == ["p0", "p1"]


def test_sandbox_failure_is_infra_error_for_that_call_only():
    sandbox = FakeSandbox()
    scripts = {("crash", 0): [call("A.", "print('CRASH')"), call("B.", "print(42)"), answer("42")],
               ("fine", 0): [call("A.", "print(1)"), answer("42")]}
    batch = run(scripts, BASE, sandbox=sandbox)
    crash = segments_of(batch, "it0-crash-s0")
    assert [(s.tool_status, s.error_type) for s in crash if s.kind == "tool"] == [
        ("infra_error", "ConnectionError"), ("ok", None)]
    assert "reason: infra_error" in crash[2].text
    assert crash[3].attempt == 1  # an infra failure is still a failed call: the model retries
    assert [s.tool_status for s in segments_of(batch, "it0-fine-s0") if s.kind == "tool"] == ["ok"]
    assert Counter(sandbox.codes) == {"print('CRASH')": 2, "print(1)": 1, "print(42)": 1}  # raised, tried once more
    assert {r.finish_reason for r in batch.rollouts} == {"answer"}


def test_infra_faults_get_advantage_zero_and_stay_out_of_group_statistics():
    config = dataclasses.replace(BASE, group_size=4, batch_rollouts=4)
    scripts = {("g", 0): [call("A.", "print(1)"), answer("42")],
               ("g", 1): [call("A.", "print(1)"), answer("41")],
               ("g", 2): [call("A.", "print(1)"), answer("42")],
               # every attempt crashes the sandbox: the last call stays infra_error
               ("g", 3): [call(f"A{i}.", "print('CRASH')") for i in range(4)] + [answer("41")]}
    batch = run(scripts, config)
    rows, stats = render_iteration(batch.rollouts, batch.segments, PurifyConfig(), CHAT.decode)
    by_sample = {int(row.rollout_id[-1]): row for row in rows}
    assert [by_sample[i].infra_fault for i in range(4)] == [False, False, False, True]
    assert by_sample[3].advantage == 0.0
    # The others' statistics are those of the group {1, 0, 1}: mean 2/3, sample std sqrt(1/3).
    eps = PurifyConfig().advantage_eps
    expected = [(1 / 3) / (math.sqrt(1 / 3) + eps), (-2 / 3) / (math.sqrt(1 / 3) + eps),
                (1 / 3) / (math.sqrt(1 / 3) + eps)]
    assert [by_sample[i].advantage for i in range(3)] == pytest.approx(expected, rel=1e-6)
    assert stats.n_infra_fault == 1
    # a warehouse of an earlier version holds rollouts a backend fault ended (finish_reason error):
    # they are infra faults too
    ended = dataclasses.replace(batch.rollouts[0], finish_reason="error")
    rows, stats = render_iteration([ended, *batch.rollouts[1:]], batch.segments, PurifyConfig(), CHAT.decode)
    assert stats.n_infra_fault == 2 and {row.rollout_id: row.advantage for row in rows}["it0-g-s0"] == 0.0


def test_malformed_call_is_a_format_error_and_not_run():
    sandbox = FakeSandbox()
    bad = '<tool_call>\n{"name": "code_interpreter", "arguments": {"cod": 1}}\n</tool_call>'
    batch = run({("bad", 0): ["Hmm." + bad, call("Fix.", "print(42)"), answer("42")]}, BASE,
                sandbox=sandbox)
    segments = segments_of(batch, "it0-bad-s0")
    assert (segments[1].call_start, segments[1].tool_code) == (4, None)
    tool = segments[2]
    assert (tool.tool_status, tool.error_type, tool.tool_code, tool.exec_ms) == (
        "format_error", "FormatError", None, None)
    assert tool.text == tool_response_text(format_tool_response(
        False, "", 'the call needs "arguments": {"code": "..."}', "format_error"))
    assert sandbox.codes == ["print(42)"]
    assert (segments[3].step, segments[3].attempt) == (0, 1)
    assert batch.rollouts[0].n_failed_calls == 1 and batch.rollouts[0].correct


def test_raw_view_constant_matches_view_for():
    assert view_for(0.99, True, SaarRollback(gamma=0.5, rollback_prob=0.5)) == RAW


# ---------------------------------------------------------------------------------------------
# verl's tool response length and the no-tool baseline


def test_a_long_tool_response_keeps_its_halves_as_verl_cuts_it():
    """verl's max_tool_response_length (middle side): the first and last limit // 2 characters
    around "...(truncated)...", the failure told from the whole answer."""
    config = dataclasses.replace(BASE, max_tool_response_chars=20)
    batch = run({("long", 0): [call("A.", "print('" + "x" * 40 + "')"), answer("42.")]}, config)
    (tool,) = [s for s in segments_of(batch, "it0-long-s0") if s.kind == "tool"]
    whole = format_tool_response(True, "print('" + "x" * 40 + "')", "")  # the fake sandbox prints the code
    assert len(whole) > 20
    assert tool.text == tool_response_text(whole[:10] + "...(truncated)..." + whole[-10:])
    assert tool.tool_status == "ok"
    short = dataclasses.replace(BASE, max_tool_response_chars=len(whole))
    batch = run({("long", 0): [call("A.", "print('" + "x" * 40 + "')"), answer("42.")]}, short)
    assert [s.text for s in batch.segments if s.kind == "tool"] == [tool_response_text(whole)]


def test_truncated_matches_verls_arithmetic():
    assert truncated("abcdefghij", 4) == "ab...(truncated)...ij"
    assert truncated("abcdefghij", 5) == "ab...(truncated)...ij"  # an odd limit keeps 2 x (limit // 2)
    assert truncated("abcdefghij", 10) == "abcdefghij"
    assert truncated("abcdefghij", None) == "abcdefghij"


def test_without_tools_a_rollout_is_one_generation_whatever_it_writes():
    """The no-tool baseline (verl's multi_turn.enable=False): no tool in the template, and a call
    the model writes anyway is part of its one answer, never run."""
    config = dataclasses.replace(BASE, multi_turn=False)
    sandbox = FakeSandbox()
    chat = ChatFormat(CharTokenizer(), ())
    backend = ScriptedBackend({("bare", 0): [call("A.", "print(1)"), answer("42.")]}, config)
    batches = collect_parts([task("bare")], config, backend, sandbox, chat, reward_fn=fake_reward, progress=False)
    segments = [s for b in batches for s in b.segments]
    assert [s.kind for s in segments] == ["prompt", "assistant"]
    assert segments[1].text == call("A.", "print(1)") and segments[1].call_start is None
    assert sandbox.codes == []
    assert batches[0].rollouts[0].finish_reason == "answer" and batches[0].rollouts[0].n_tool_calls == 0


def test_the_no_tool_baseline_refuses_tools():
    with pytest.raises(ValueError, match="multi_turn off runs without any tool"):
        dataclasses.replace(BASE, multi_turn=False, tool="tools.py:convert")
