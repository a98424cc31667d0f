"""A reward function from the user's file (grading/reward_file.py), called as verl calls one, and the
agent loop that hands it verl's arguments: the response after the prompt as the rollout's view
renders it, decoded without special tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import textwrap

import numpy as np
import pytest

from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import Task
from cleaner.engine.grading.answers import RewardResult
from cleaner.engine.grading.reward_file import RewardFunction, RewardFunctionError
from cleaner.engine.model.chat import ChatFormat
from cleaner.plugins import PluginError
from tests.agent_fakes import (
    BASE,
    CharTokenizer,
    FakeSandbox,
    ScriptedBackend,
    answer,
    call,
    collect_parts,
    fake_reward,
)

VERL_STYLE = '''
import re

import json
import pathlib

CALLS = pathlib.Path(__file__).with_suffix(".calls")  # every call's arguments, a JSON line each (a
                                                      # reward worker process writes them)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with CALLS.open("a") as calls:
        calls.write(json.dumps(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                    extra_info=extra_info)) + "\\n")
    boxed = re.findall(r"\\\\boxed\\{([^}]*)\\}", solution_str)
    pred = boxed[-1] if boxed else None
    acc = pred == ground_truth
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred, "source": data_source}


def as_number(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) % 3


def raises(data_source, solution_str, ground_truth, extra_info=None):
    if "boom" in solution_str:
        raise ValueError("cannot parse " + ground_truth)
    return 1.0
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(VERL_STYLE))
    return path


def score(function: RewardFunction, solution: str = "x", extra=None) -> RewardResult:
    return asyncio.run(function.score("r0", "toy", solution, "42", extra))


# ---------------------------------------------------------------------------------------------
# Loading and calling


def test_a_file_alone_means_compute_score(reward_file):
    function = RewardFunction.load(str(reward_file))
    assert function.function.__name__ == "compute_score"
    assert RewardFunction.load(f"{reward_file}:as_number").name == "as_number"


@pytest.mark.parametrize(("spec", "message"), [
    ("{d}/none.py:f", "reward function '{d}/none.py:f': no such file {d}/none.py"),
    ("{d}/reward.py:nothing", "reward function '{d}/reward.py:nothing': {d}/reward.py has no 'nothing'; it defines "
                              "CALLS, as_number, compute_score, json, pathlib, raises, re"),
    ("{d}/reward.py:CALLS", "reward function '{d}/reward.py:CALLS': PosixPath is not callable"),
    ("justaname", "reward function 'justaname': expected PATH.py:NAME (the file and the name of the object in it)"),
    ("not_a_module_here.f", "reward function 'not_a_module_here.f': cannot import module 'not_a_module_here' "
                            "(ModuleNotFoundError: No module named 'not_a_module_here')"),
    ("{d}/two.py:f", "reward function '{d}/two.py:f': it must take (data_source, solution_str, ground_truth, "
                     "extra_info) as keywords, as verl calls it (missing a required argument: 'text')"),
])
def test_a_function_that_cannot_load_is_one_line(reward_file, spec, message):
    (reward_file.parent / "two.py").write_text("def f(text, truth):\n    return 1\n")
    with pytest.raises(PluginError) as raised:
        RewardFunction.load(spec.format(d=reward_file.parent))
    assert str(raised.value).startswith(message.format(d=reward_file.parent))


@pytest.mark.parametrize(("returned", "expected"), [
    (1, RewardResult(1.0, True, None)),
    (0.0, RewardResult(0.0, False, None)),
    (True, RewardResult(1.0, True, None)),
    (np.float32(0.5), RewardResult(0.5, True, None)),
    (np.bool_(False), RewardResult(0.0, False, None)),
    ({"score": -1.0, "acc": np.bool_(False), "pred": "41"}, RewardResult(-1.0, False, "41", '{"acc": false, "pred": "41"}')),
    ({"score": 0.5, "extra": [np.int64(3), {"k": np.float64(0.25)}]},  # no acc: correct is score > 0
     RewardResult(0.5, True, None, '{"extra": [3, {"k": 0.25}]}')),
    ({"score": 1, "acc": 0, "pred": 7}, RewardResult(1.0, False, "7", '{"acc": 0, "pred": 7}')),
])
def test_numbers_and_dicts_as_verl_takes_them(returned, expected):
    assert score(RewardFunction("f.py:f", lambda **_: returned)) == expected


NOT_A_REWARD = "not a finite number a float32 holds (|x| <= 3.403e+38)"


@pytest.mark.parametrize(("returned", "what"), [
    ("1.0", "str '1.0', " + NOT_A_REWARD),
    (None, "NoneType None, " + NOT_A_REWARD),
    (float("nan"), "float nan, " + NOT_A_REWARD),
    ({"reward": 1.0}, "a dict without a 'score' key (keys: ['reward'])"),
    ({"score": "high"}, "str 'high', " + NOT_A_REWARD),
    # beyond float32, the warehouse's reward column: stored as inf, it would turn advantages into NaN
    (1e39, "float 1e+39, " + NOT_A_REWARD),
    (-3.5e38, "float -3.5e+38, " + NOT_A_REWARD),
    (10**400, "int " + repr(10**400)[:80] + ", " + NOT_A_REWARD),
])
def test_anything_else_is_one_error_naming_the_function_and_rollout(returned, what):
    def judge(**_):
        return returned

    with pytest.raises(RewardFunctionError) as raised:
        score(RewardFunction("my/reward.py:judge", judge))
    assert str(raised.value) == (f"reward function judge (my/reward.py:judge) returned {what} on rollout r0; it "
                                 "must return a number or a dict with a 'score' number")


@pytest.mark.parametrize(("acc", "what"), [
    ("no", "str 'no'"),  # Python's truth would make it correct
    ("False", "str 'False'"),
    (None, "NoneType None"),
    ([0], "list [0]"),
    (float("nan"), "float nan"),
])
def test_an_acc_that_is_not_a_bool_or_a_number_is_one_error_naming_it(acc, what):
    def judge(**_):
        return {"score": 1.0, "acc": acc}

    with pytest.raises(RewardFunctionError) as raised:
        score(RewardFunction("my/reward.py:judge", judge))
    assert str(raised.value) == (f"reward function judge (my/reward.py:judge) returned a dict whose 'acc' is {what}, "
                                 "not a bool or a finite number, on rollout r0; a dict's 'acc' (the rollout's correct) "
                                 "is a bool or a number")


@pytest.mark.parametrize(("acc", "correct"), [(True, True), (np.bool_(True), True), (1.0, True), (0.0, False),
                                              (-1, False), (np.int64(0), False)])
def test_a_number_acc_is_correct_when_positive(acc, correct):
    assert score(RewardFunction("f.py:f", lambda **_: {"score": 0.0, "acc": acc})).correct is correct


def test_a_raising_function_is_one_error_naming_it_the_rollout_and_the_exception(reward_file):
    function = RewardFunction.load(f"{reward_file}:raises")
    with pytest.raises(RewardFunctionError) as raised:
        score(function, "boom")
    assert str(raised.value) == (f"reward function raises ({reward_file}:raises) raised on rollout r0: "
                                 "ValueError: cannot parse 42")


def test_a_coroutine_function_is_awaited():
    async def judge(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0)
        return {"score": 2.0, "pred": solution_str}

    assert score(RewardFunction("f.py:judge", judge), "abc") == RewardResult(2.0, True, "abc", '{"pred": "abc"}')


# ---------------------------------------------------------------------------------------------
# The agent loop: verl's arguments


class QwenLikeTokenizer(CharTokenizer):
    """As Qwen's: <|im_start|> and <|im_end|> are special tokens, the tool tags are not."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return super().decode([i for i in ids if not (skip_special_tokens and i in (0, 1))])


CHAT = ChatFormat(QwenLikeTokenizer())
SCRIPTS = {
    ("fixed", 0): [call("Let me compute.", "print(6*7+oops)"), call("Fixed.", "print(6*7)"),
                   answer("The answer is \\boxed{42}.")],
    ("direct", 0): [answer("Easy: \\boxed{41}.")],
}
SUCCESS = "\nuser\n<tool_response>\nTool call success\nstdout: print(6*7)\n</tool_response>\nassistant\n"
FAILURE = ("\nuser\n<tool_response>\nTool call failure\nreason: error\nstderr: NameError: name 'oops' is not "
           "defined\n</tool_response>\nassistant\n")


def call_text(code: str) -> str:
    return f'<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "{code}"}}}}\n</tool_call>'


def collect_with(function: RewardFunction, config=BASE, scripts=SCRIPTS, tasks=None):
    tasks = tasks or [Task(p, ({"role": "user", "content": f"Question {p}?"},), "42", "toy", extra_info={"index": i})
                      for i, p in enumerate(dict.fromkeys(p for p, _ in scripts))]
    parts = collect_parts(tasks, config, ScriptedBackend(scripts, config), FakeSandbox(), CHAT, reward_fn=fake_reward,
                          progress=False, reward_file=function)
    return [r for part in parts for r in part.rollouts]


@pytest.mark.parametrize("collect_view", ["purified", "raw"])
def test_solution_str_is_the_views_response_without_special_tokens(reward_file, collect_view):
    function = RewardFunction.load(str(reward_file))
    rollouts = collect_with(function, dataclasses.replace(BASE, collect_view=collect_view))
    calls = [json.loads(line) for line in reward_file.with_suffix(".calls").read_text().splitlines()]
    by_id = {call["solution_str"]: call for call in calls}
    fixed = ("Let me compute." + call_text("print(6*7)") + SUCCESS if collect_view == "purified"  # SAAR's shallow merge
             else "Let me compute." + call_text("print(6*7+oops)") + FAILURE + "Fixed." + call_text("print(6*7)") + SUCCESS)
    fixed += "The answer is \\boxed{42}."
    assert sorted(by_id) == sorted([fixed, "Easy: \\boxed{41}."])
    # the dataset row's extra_info, plus verl's num_turns (generations and tool responses, plus one)
    # and the tools' rewards, rollout_reward_scores and tool_rewards (the code interpreter gives none)
    none = {"rollout_reward_scores": {}, "tool_rewards": []}
    assert by_id[fixed]["extra_info"] == {"index": 0, "num_turns": 6, **none}
    assert by_id["Easy: \\boxed{41}."]["extra_info"] == {"index": 1, "num_turns": 2, **none}
    assert {c["ground_truth"] for c in calls} == {"42"} and {c["data_source"] for c in calls} == {"toy"}
    stored = {r.rollout_id: (r.reward, r.correct, r.answer, json.loads(r.reward_details)) for r in rollouts}
    assert stored == {"it0-fixed-s0": (1.0, True, "42", {"acc": True, "pred": "42", "source": "toy"}),
                      "it0-direct-s0": (-1.0, False, "41", {"acc": False, "pred": "41", "source": "toy"})}


def test_a_raising_function_stops_the_collection_and_parts_before_stay(reward_file):
    function = RewardFunction.load(f"{reward_file}:raises")
    scripts = {(f"p{i}", 0): [answer(f"fine {i}")] for i in range(3)} | {("p3", 0): [answer("boom")]}
    config = dataclasses.replace(BASE, batch_rollouts=1, max_concurrent_rollouts=1)
    tasks = [Task(f"p{i}", ({"role": "user", "content": "?"},), "42", "toy") for i in range(4)]
    committed = []
    with pytest.raises(RewardFunctionError, match=r"^reward function raises \(.*:raises\) raised on rollout "
                                                  r"it0-p3-s0: ValueError: cannot parse 42$"):
        collect(tasks, config, ScriptedBackend(scripts, config), FakeSandbox(), CHAT,
                write=lambda part: committed.extend(r.rollout_id for r in part.rollouts),
                reward_fn=fake_reward, progress=False, reward_file=function)
    assert committed == ["it0-p0-s0", "it0-p1-s0", "it0-p2-s0"]


def test_a_function_that_changes_extra_info_changes_no_later_rollout():
    """Each call gets its own copy of the row's extra_info, nested values included."""
    seen = []

    def judge(data_source, solution_str, ground_truth, extra_info):
        seen.append(json.dumps(extra_info, sort_keys=True))
        extra_info["tags"].append("seen")
        return 1.0

    config = dataclasses.replace(BASE, group_size=3, max_concurrent_rollouts=1)
    scripts = {("p", i): [answer("42")] for i in range(3)}
    tasks = [Task("p", ({"role": "user", "content": "?"},), "42", "toy", extra_info={"tags": ["a"]})]
    collect_parts(tasks, config, ScriptedBackend(scripts, config), FakeSandbox(), CHAT, reward_fn=fake_reward,
                  progress=False, reward_file=RewardFunction("judge.py:judge", judge))
    assert seen == ['{"num_turns": 2, "rollout_reward_scores": {}, "tags": ["a"], "tool_rewards": []}'] * 3
    assert tasks[0].extra_info == {"tags": ["a"]}


def test_a_reward_function_runs_in_a_worker_process_on_its_main_thread(reward_file):
    """A function loaded from its file runs in a reward worker, whose main thread takes signal-based
    timeouts (math-verify's, which verl's reward functions use)."""
    import os

    reward_file.write_text(
        "import os, signal, threading\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # raises off the main thread\n"
        "    return {'score': 1.0, 'pid': os.getpid(), 'main': threading.current_thread() is threading.main_thread()}\n")
    rollouts = collect_with(RewardFunction.load(str(reward_file)), scripts={("p", 0): [answer("42")]})
    details = json.loads(rollouts[0].reward_details)
    assert details["main"] is True and details["pid"] != os.getpid()


def test_the_ground_truth_reaches_the_function_as_the_row_held_it(reward_file):
    """verl hands `reward_model.ground_truth` over as the row holds it; so does the worker process,
    while the warehouse stores its text (JSON where it is not a string)."""
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': 1.0, 'type': type(ground_truth).__name__, 'truth': ground_truth}\n")
    truths = {"d": {"inputs": ["1\n"], "outputs": ["2\n"]}, "l": ["3/4", "0.75"], "n": 42, "s": None}
    tasks = [Task(p, ({"role": "user", "content": "?"},), "x" if truth is None else json.dumps(truth), "toy",
                  truth=truth) for p, truth in truths.items()]
    rollouts = collect_with(RewardFunction.load(str(reward_file)), scripts={(p, 0): [answer("42")] for p in truths},
                            tasks=tasks)
    got = {r.prompt_id: (json.loads(r.reward_details), r.ground_truth) for r in rollouts}
    assert got == {
        "d": ({"type": "dict", "truth": truths["d"]}, '{"inputs": ["1\\n"], "outputs": ["2\\n"]}'),
        "l": ({"type": "list", "truth": ["3/4", "0.75"]}, '["3/4", "0.75"]'),
        "n": ({"type": "int", "truth": 42}, "42"),
        "s": ({"type": "str", "truth": "x"}, "x"),
    }
