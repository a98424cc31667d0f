"""Tools beside Python (cleaner/tools/): the call parser, the toolbox, loading, and the agent loop
with a second tool, whose failure-and-retry chains SAAR merges as it merges the Python tool's.

The scripted backend and fake sandbox are tests/agent_fakes.py's; the second tool is the example's
unit converter (examples/units/tools.py), loaded from its YAML as a user would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cleaner.config import PurifyConfig
from cleaner.engine.collect.schedule import collect
from cleaner.engine.grading.reward_file import RewardFunction
from cleaner.engine.model.chat import (
    ChatFormat,
    ToolCall,
    format_tool_call,
    parse_tool_call,
    tool_response_text,
)
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.saar.walk import render, view_for
from cleaner.plugins import PluginError
from cleaner.tools import CallContext, Tool, Toolbox, ToolError, ToolResult, load_tools
from cleaner.tools.responses import format_tool_response, format_tool_text
from tests.agent_fakes import (
    BASE,
    CHAINS,
    EXAMPLE,
    UNIT_CHAT,
    UNITS,
    CharTokenizer,
    FakeSandbox,
    ScriptedBackend,
    answer,
    arguments,
    call,
    collect_parts,
    convert,
    fake_reward,
    run_units,
    task,
)
from tests.helpers import comparable

PARAMETERS = {tool.name: tool.parameters for tool in UNITS}


# ---------------------------------------------------------------------------------------------
# The call parser


def test_a_user_tools_call_is_parsed_to_its_arguments():
    text = convert("Convert.", 3.5, "km", "m")
    assert parse_tool_call(text, PARAMETERS) == ToolCall(
        arguments(3.5, "km", "m"), None, "convert_units", {"value": 3.5, "from_unit": "km", "to_unit": "m"})
    # without the tool in the collection, the same call names an unknown tool
    assert parse_tool_call(text) == ToolCall(None, "unknown tool 'convert_units'; the only tool is code_interpreter",
                                             "convert_units")


def test_arguments_the_schema_refuses_are_a_format_error():
    missing = 'x<tool_call>\n{"name": "convert_units", "arguments": {"value": 1, "from_unit": "km"}}\n</tool_call>'
    assert parse_tool_call(missing, PARAMETERS) == ToolCall(
        None, "the arguments do not fit convert_units's parameters: \"'to_unit' is a required property\"",
        "convert_units")
    typed = convert("x", "three", "km", "m")
    assert parse_tool_call(typed, PARAMETERS).error == (
        "the arguments do not fit convert_units's parameters: \"'three' is not of type 'number'\" "
        "(at arguments['value'])")
    listed = 'x<tool_call>\n{"name": "convert_units", "arguments": [1, "km", "m"]}\n</tool_call>'
    assert parse_tool_call(listed, PARAMETERS).error == (
        'the call needs "arguments" as a JSON object, got [1, \'km\', \'m\']')
    unknown = 'x<tool_call>\n{"name": "convert", "arguments": {}}\n</tool_call>'
    assert parse_tool_call(unknown, PARAMETERS) == ToolCall(
        None, "unknown tool 'convert'; the tools are code_interpreter, convert_units", "convert")


def test_the_template_shows_every_tool_the_code_interpreter_first():
    seen = []

    class Recording(CharTokenizer):
        def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True):
            seen.append([tool["function"]["name"] for tool in tools])
            return super().apply_chat_template(messages, tools, add_generation_prompt, tokenize)

    box = Toolbox(UNITS)
    ChatFormat(Recording(), box.schemas).prompt_ids([{"role": "user", "content": "hi"}])
    assert seen == [["code_interpreter", "convert_units"]]


# ---------------------------------------------------------------------------------------------
# The toolbox


def run_call(box: Toolbox, name: str, args: dict):
    return asyncio.run(box.run(name, args))


def test_a_call_returns_text_ok_or_failed():
    box = Toolbox(UNITS)
    done = run_call(box, "convert_units", {"value": 3.5, "from_unit": "km", "to_unit": "m"})
    assert (done.status, done.error_type, done.text) == ("ok", None, "3500 m")
    raised = run_call(box, "convert_units", {"value": 3.5, "from_unit": "kms", "to_unit": "m"})
    assert (raised.status, raised.error_type) == ("error", "ValueError")
    assert raised.text.startswith("ValueError: unknown unit 'kms'; the units are mm, cm, m, km")
    refused = run_call(box, "convert_units", {"value": 2, "from_unit": "kg", "to_unit": "m"})
    assert (refused.status, refused.error_type, refused.text) == (
        "error", "DimensionError", "cannot convert mass (kg) to length (m)")


class Sleepy(Tool):
    name = "sleepy"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}
    timeout_s = 1.0  # the fast call's 0.01 s is far within it on a loaded machine; the slow call's 3 s is not

    def call(self, arguments):
        time.sleep(arguments["s"])
        return "woke"


class AsyncSleepy(Sleepy):
    name = "async_sleepy"

    async def call(self, arguments):
        await asyncio.sleep(arguments["s"])
        return "woke"


@pytest.mark.parametrize("tool", [Sleepy(), AsyncSleepy()], ids=["thread", "coroutine"])
def test_a_call_past_its_timeout_is_answered_at_once_and_blocks_no_other(tool):
    box = Toolbox([tool])

    async def both():
        started = time.monotonic()
        slow, fast = await asyncio.gather(box.run(tool.name, {"s": 3.0}), box.run(tool.name, {"s": 0.01}))
        return slow, fast, time.monotonic() - started

    slow, fast, seconds = asyncio.run(both())
    assert (slow.status, slow.error_type, slow.text) == ("timeout", "TimeoutError", "the call ran past its 1 s timeout")
    assert (fast.status, fast.text) == ("ok", "woke")
    assert seconds < 2.5  # the timed-out call (3 s) did not hold the other, nor the caller
    box.close()


def test_a_plain_coroutine_function_is_a_tool(tmp_path):
    """`async def` with type hints and a docstring: its schema read as a function's, awaited."""
    path = tmp_path / "lookup.py"
    path.write_text(
        "import asyncio\n\n"
        "async def lookup(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: what to look up\n    """\n'
        "    await asyncio.sleep(0.01)\n"
        "    return key.upper()\n")
    (tool,) = load_tools(None, f"{path}:lookup")
    assert tool.schema["function"]["parameters"]["properties"] == {"key": {"type": "string", "description": "what to look up"}}
    done = run_call(Toolbox([tool]), "lookup", {"key": "abc"})
    assert (done.status, done.text) == ("ok", "ABC")


def test_the_tools_own_timeout_error_is_its_services_fault_not_a_timeout(monkeypatch):
    """Its upstream timing out is not the call's timeout, nor the model's failure: infra_error."""
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.01)

    class Raises(Tool):
        name = "raises"

        def call(self, arguments):
            raise TimeoutError("upstream service timed out")

    done = run_call(Toolbox([Raises()]), "raises", {})
    assert (done.status, done.error_type, done.text) == (
        "infra_error", "ToolUnavailable", "the tool's service failed: TimeoutError: upstream service timed out")


class Faulty(Tool):
    """Raises `error` from `create` or from its call (`where`)."""

    name = "faulty"
    parameters = {"type": "object", "properties": {}}

    def __init__(self, where: str, error: Exception) -> None:
        super().__init__()
        self.where, self.error = where, error

    def create(self, context):
        if self.where == "create":
            raise self.error

    def call(self, arguments):
        if self.where == "call":
            raise self.error
        return "fine"


class AsyncFaulty(Faulty):
    async def create(self, context):
        Faulty.create(self, context)

    async def call(self, arguments):
        return Faulty.call(self, arguments)


@pytest.mark.parametrize("kind", [Faulty, AsyncFaulty], ids=["thread", "coroutine"])
def test_one_reading_of_a_fault_for_every_tool(kind, monkeypatch):
    """As a verl tool's: an exception that is not an argument error is the service's (infra_error,
    after its tries), from `create` or from the call; an argument error of the call is the model's
    failed call; one of `create` (which never sees the model's arguments) is one line."""
    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.01)

    def outcome(where: str, error: Exception):
        box = Toolbox([kind(where, error)])
        try:
            done = asyncio.run(box.run("faulty", {}, CallContext("it0-p-s0", {"faulty": {"create_kwargs": {"n": 1}}})))
        finally:
            box.close()
        return done.status, done.error_type, done.text

    service = ("infra_error", "ToolUnavailable", "the tool's service failed: RuntimeError: judge down")
    assert outcome("create", RuntimeError("judge down")) == service
    assert outcome("call", RuntimeError("judge down")) == service
    assert outcome("call", ZeroDivisionError("division by zero")) == (
        "error", "ZeroDivisionError", "ZeroDivisionError: division by zero")
    assert outcome("call", KeyError("unit")) == ("error", "KeyError", "KeyError: 'unit'")
    assert outcome("create", OSError("no judge")) == (
        "infra_error", "ToolUnavailable", "the tool's service failed: OSError: no judge")
    with pytest.raises(ToolError, match=r"^tool 'faulty': create raised KeyError: 'table' on rollout it0-p-s0; create "
                                        r"never sees the model's arguments, so this is the row's or the tool's problem "
                                        r"\(the row's extra_info.tools_kwargs.faulty.create_kwargs has \['n'\]\)$"):
        outcome("create", KeyError("table"))


@pytest.mark.parametrize("coroutine", [False, True], ids=["thread", "coroutine"])
def test_a_create_past_its_timeout_is_the_services_never_the_models(coroutine, monkeypatch):
    """`create` never sees the model's arguments: one that hangs past the tool's timeout is its
    service's fault (infra_error after its tries), not a `timeout` SAAR would read as a failed call."""
    import time

    from cleaner.tools import toolbox as toolbox_module

    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.01)

    class SlowStart(Tool):
        name, timeout_s = "slow", 0.1
        parameters = {"type": "object", "properties": {}}

        def create(self, context):
            time.sleep(0.3)

        def call(self, arguments):
            return "fine"

    class AsyncSlowStart(SlowStart):
        async def create(self, context):
            await asyncio.sleep(0.3)

        async def call(self, arguments):
            return "fine"

    box = Toolbox([(AsyncSlowStart if coroutine else SlowStart)()])
    try:
        done = asyncio.run(box.run("slow", {}, CallContext("it0-p-s0")))
    finally:
        box.close()
    assert (done.status, done.error_type, done.text) == (
        "infra_error", "ToolUnavailable", "the tool's service failed: create ran past its 0.1 s timeout")


def test_a_tool_returning_neither_text_nor_a_result_is_one_error():
    class Broken(Tool):
        name = "broken"

        def call(self, arguments):
            return 42

    with pytest.raises(ToolError, match=r"^tool 'broken' returned int \(42\); a tool returns a str or a "
                                        r"cleaner.tools.ToolResult$"):
        run_call(Toolbox([Broken()]), "broken", {})


def test_long_output_is_cut_as_the_sandbox_cuts_it():
    class Loud(Tool):
        name = "loud"

        def call(self, arguments):
            return ToolResult("x" * 100, ok=False)

    done = run_call(Toolbox([Loud()], max_output_chars=64), "loud", {})
    assert (done.status, done.error_type, done.text) == ("error", "ToolError", "x" * 64 + "...[truncated 36 chars]")


# ---------------------------------------------------------------------------------------------
# Loading


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_a_documented_function_is_a_tool(tmp_path):
    write(tmp_path / "fns.py", '''
        def add(a: int, b: int) -> str:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            return str(a + b)
    ''')
    (tool,) = load_tools(None, f"{tmp_path}/fns.py:add")
    assert tool.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first."},
                                                        "b": {"type": "integer", "description": "The second."}},
                       "required": ["a", "b"]}}}
    assert run_call(Toolbox([tool]), "add", {"a": 2, "b": 3}).text == "5"


def test_a_tool_file_imports_the_files_beside_it(tmp_path, monkeypatch):
    """As it would run as a script: its folder is on the path."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    write(tmp_path / "helpers_beside.py", "FACTOR = 3\n")
    write(tmp_path / "uses.py", '''
        from helpers_beside import FACTOR

        def triple(a: int) -> str:
            """Triple it.

            Args:
                a: The number.
            """
            return str(FACTOR * a)
    ''')
    (tool,) = load_tools(None, f"{tmp_path}/uses.py:triple")
    assert run_call(Toolbox([tool]), "triple", {"a": 2}).text == "6"
    del sys.modules["helpers_beside"]


def test_the_yaml_is_verls_layout_its_schema_and_config_win(tmp_path):
    (tool,) = UNITS
    assert (tool.name, tool.timeout_s, tool.digits) == ("convert_units", 2.0, 6)
    assert tool.description == "Convert a quantity from one unit to another, e.g. 3.5 km to m."
    two = load_tools(str(EXAMPLE / "tools.yaml"), f"{EXAMPLE}/tools.py:unit_factor")
    assert [t.name for t in two] == ["convert_units", "unit_factor"]


@pytest.mark.parametrize(("setup", "spec", "message"), [
    (None, "{d}/none.py:f", "tool '{d}/none.py:f': no such file {d}/none.py"),
    ("def f(:\n", "{d}/t.py:f", "tool '{d}/t.py:f': importing {d}/t.py failed (line 1): SyntaxError: "),
    ("import not_a_module_here\n", "{d}/t.py:f",
     "tool '{d}/t.py:f': importing {d}/t.py failed: ModuleNotFoundError: No module named 'not_a_module_here'"),
    ("def g():\n    pass\n", "{d}/t.py:f", "tool '{d}/t.py:f': {d}/t.py has no 'f'; it defines g"),
    ("def f(x):\n    return x\n", "{d}/t.py:f", "tool '{d}/t.py:f': cannot read a schema from f's signature"),
    ("from cleaner.tools import Tool\nclass f(Tool):\n    name = 'x'\n    parameters = {'type': 'string'}\n",
     "{d}/t.py:f", "tool '{d}/t.py:f': its parameters must be a JSON schema of type object"),
    ("from cleaner.tools import Tool\nclass f(Tool):\n    name = 'x'\n    parameters = {'type': 7}\n",
     "{d}/t.py:f", "tool '{d}/t.py:f': its parameters are not a valid JSON schema (7 is not valid under any"),
])
def test_a_tool_that_cannot_load_is_one_line(tmp_path, setup, spec, message):
    if setup is not None:
        write(tmp_path / "t.py", setup)
    spec, message = spec.format(d=tmp_path), message.format(d=tmp_path)
    with pytest.raises(PluginError) as raised:
        load_tools(None, spec)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_two_tools_of_one_name_and_a_bad_yaml_are_refused(tmp_path):
    spec = f"{EXAMPLE}/tools.py:unit_factor"
    with pytest.raises(ToolError, match="^tool 'unit_factor': the name is another tool's; give each tool its own$"):
        load_tools(None, f"{spec},{spec}")
    bad = write(tmp_path / "tools.yaml", "tools:\n  - config: {}\n")
    with pytest.raises(ToolError, match=r"tools\[0\] needs a `class_name` \(PATH.py:Class or module.Class\)$"):
        load_tools(str(bad), None)
    empty = write(tmp_path / "empty.yaml", "tool: []\n")
    with pytest.raises(ToolError, match=r"expected a `tools:` list of \{class_name, config, tool_schema\}"):
        load_tools(str(empty), None)


def test_a_tool_named_code_interpreter_takes_the_built_in_ones_place():
    """As the reference's code-judge tool does: the template shows its schema first, and its calls
    go to it, never to the sandbox."""
    class Judge(Tool):
        name, description = "code_interpreter", "A tool for executing code."
        parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

        def call(self, arguments):
            return f"Tool call success\nstdout: judged {arguments['code']}"

    box = Toolbox([Judge(), *UNITS])
    assert [schema["function"]["name"] for schema in box.schemas] == ["code_interpreter", "convert_units"]
    assert box.schemas[0]["function"]["description"] == "A tool for executing code."
    chat, sandbox = ChatFormat(CharTokenizer(), box.schemas), FakeSandbox()
    scripts = {("p", 0): [call("Run.", "print(1)"), answer("42")]}
    parts = collect_parts([task("p")], BASE, ScriptedBackend(scripts, BASE), sandbox, chat, reward_fn=fake_reward,
                          progress=False, toolbox=box)
    (tool,) = [s for part in parts for s in part.segments if s.kind == "tool"]
    assert (tool.tool_name, tool.tool_status, tool.tool_code) == ("code_interpreter", "ok", '{"code": "print(1)"}')
    assert tool.text == tool_response_text(format_tool_text(True, "Tool call success\nstdout: judged print(1)"))
    assert sandbox.codes == []


# ---------------------------------------------------------------------------------------------
# The agent loop with the second tool

def test_each_call_goes_to_the_tool_it_names_and_the_rows_say_which():
    rollouts, segments, _ = run_units(BASE)
    deep = [(s.kind, s.tool_name, s.tool_status, s.error_type, s.tool_code) for s in segments
            if s.rollout_id == "it0-deep-s0" and s.kind != "prompt"]
    assert deep == [
        ("assistant", "convert_units", None, None, arguments(2, "kg", "m")),
        ("tool", "convert_units", "error", "DimensionError", arguments(2, "kg", "m")),
        ("assistant", "code_interpreter", None, None, "print(2000 / 1000)"),
        ("tool", "code_interpreter", "ok", None, "print(2000 / 1000)"),
        ("assistant", "convert_units", None, None, arguments(2, "km", "m")),
        ("tool", "convert_units", "ok", None, arguments(2, "km", "m")),
        ("assistant", None, None, None, None),
    ]
    texts = [s.text for s in segments if s.rollout_id == "it0-deep-s0" and s.kind == "tool"]
    assert texts[0] == UNIT_CHAT.decode(UNIT_CHAT.encode(tool_response_text(
        format_tool_text(False, "cannot convert mass (kg) to length (m)", "error"))))
    assert texts[2] == tool_response_text("Tool call success\n2000 m")
    assert texts[1] == tool_response_text(format_tool_response(True, "print(2000 / 1000)", ""))


def test_the_second_tools_chains_have_the_python_tools_steps_and_contexts():
    """The replay that holds for the Python tool (tests/engine/collect/test_agent.py) holds for the
    unit converter: every context the model saw is the renderer's rendering of the stored segments
    before it, in both views, and the same number of contexts differ from raw as with CHAINS
    (1 + 2 + 4 + 0)."""
    for collect_view in ("purified", "raw"):
        config = dataclasses.replace(BASE, collect_view=collect_view)
        rollouts, segments, contexts = run_units(config)
        _, python_segments, _ = run_python(config)
        differs = 0
        for rollout in rollouts:
            mine = sorted((s for s in segments if s.rollout_id == rollout.rollout_id), key=lambda s: s.seq)
            python = sorted((s for s in python_segments if s.rollout_id == rollout.rollout_id), key=lambda s: s.seq)
            assert [(s.kind, s.step, s.attempt, s.tool_status) for s in mine] == \
                   [(s.kind, s.step, s.attempt, s.tool_status) for s in python]
            view = view_for(rollout.rollback_draw, collect_view == "purified", config)
            assistants = [s for s in mine if s.kind == "assistant"]
            for context, assistant in zip(contexts[rollout.rollout_id], assistants, strict=True):
                before = mine[: assistant.seq]
                assert context == list(render(before, view, UNIT_CHAT.decode).token_ids)
                differs += context != [t for s in before for t in s.token_ids]
        assert differs == (0 if collect_view == "raw" else 1 + 2 + 4 + 0)


def run_python(config):
    batches = collect_parts([task(p) for p in ("shallow", "deep", "exhausted", "gives_up")], config,
                            ScriptedBackend(CHAINS, config), FakeSandbox(), ChatFormat(CharTokenizer()),
                            reward_fn=fake_reward, progress=False)
    return [r for b in batches for r in b.rollouts], [s for b in batches for s in b.segments], None


def test_a_retry_that_calls_another_tool_with_the_same_arguments_is_deep():
    """convert_units fails; the retry calls a second tool with the very same arguments. Their
    tool_codes are equal, but calls of two tools are not alike (similarity 0): deep at any gamma
    above 0 (gamma 0 asks for every merge shallow)."""
    class Other(Tool):
        name = "other_units"
        parameters = UNITS[0].parameters

        def call(self, arguments):
            return "3500 m"

    box = Toolbox([*UNITS, Other()])
    chat = ChatFormat(CharTokenizer(), box.schemas)
    same = {"value": 3.5, "from_unit": "kms", "to_unit": "m"}
    scripts = {("switch", 0): ["Convert." + format_tool_call("convert_units", same),
                               "Other." + format_tool_call("other_units", same), answer("3500")]}
    config = BASE
    parts = collect_parts([task("switch")], config, ScriptedBackend(scripts, config), FakeSandbox(), chat,
                          reward_fn=fake_reward, progress=False, toolbox=box)
    rollouts, segments = parts[0].rollouts, parts[0].segments
    calls = [s for s in segments if s.kind == "assistant" and s.tool_code is not None]
    assert calls[0].tool_code == calls[1].tool_code and [c.tool_name for c in calls] == ["convert_units", "other_units"]
    for gamma in (0.01, 0.5, 0.99):
        rows, _ = render_iteration(rollouts, segments, PurifyConfig(gamma=gamma), chat.decode)
        assert (rows[0].n_shallow, rows[0].n_deep) == (0, 1)


def test_purify_merges_the_second_tools_chains_as_the_python_tools():
    """Shallow and deep as the Python chains: the misspelt unit is shallow (its arguments are
    similar), the switch to Python deep, the exhausted chain's three similar retries shallow and the
    chain unrecovered."""
    rollouts, segments, _ = run_units(BASE)
    rows, stats = render_iteration(rollouts, segments, PurifyConfig(), UNIT_CHAT.decode)
    merges = {row.rollout_id: (row.n_shallow, row.n_deep, row.n_unrecovered) for row in rows}
    python_rollouts, python_segments, _ = run_python(BASE)
    python_rows, _ = render_iteration(python_rollouts, python_segments, PurifyConfig(), UNIT_CHAT.decode)
    assert merges == {row.rollout_id: (row.n_shallow, row.n_deep, row.n_unrecovered) for row in python_rows}
    assert merges == {"it0-shallow-s0": (1, 0, 0), "it0-deep-s0": (0, 1, 0), "it0-exhausted-s0": (3, 0, 1),
                      "it0-gives_up-s0": (0, 0, 1)}
    # the shallow row: the first attempt's reasoning, the fixed call, its answer; the error is gone
    shallow = next(row for row in rows if row.rollout_id == "it0-shallow-s0")
    text = UNIT_CHAT.decode(shallow.token_ids[shallow.prompt_len:])
    assert text == ("Let me convert." + format_tool_call("convert_units", {"value": 3.5, "from_unit": "km", "to_unit": "m"})
                    + tool_response_text("Tool call success\n3500 m") + "The answer is 3500.<|im_end|>")


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_the_schedule_never_changes_what_a_rollout_with_user_tools_contains(schedule):
    expected = run_units(BASE)[:2]
    got = run_units(dataclasses.replace(BASE, schedule=schedule, batch_rollouts=3, max_concurrent_rollouts=2))[:2]
    assert comparable(*got) == comparable(*expected)


def test_a_tool_call_does_not_hold_the_other_rollouts():
    """A rollout whose call of a slow tool runs keeps no other rollout from generating and finishing."""
    release = threading.Event()

    class Gate(Tool):
        name = "gate"
        timeout_s = 30.0

        def call(self, arguments):
            return "open" if release.wait(10) else "never released"

    scripts = {("waits", 0): ['x<tool_call>\n{"name": "gate", "arguments": {}}\n</tool_call>', answer("done")]}
    # the others take turns and Python calls of their own while the gate's call runs
    scripts |= {(f"free{i}", 0): [call("a", "print(1)"), call("b", "print(2)"), answer(f"free {i}")] for i in range(3)}
    box = Toolbox([Gate()])
    config = dataclasses.replace(BASE, batch_rollouts=1)
    finished, segments = [], []

    def write(part):
        finished.extend(r.rollout_id for r in part.rollouts)
        segments.extend(part.segments)
        if len(finished) == 3:
            release.set()  # only now may the gate's call return

    collect([task(p) for p in ("waits", "free0", "free1", "free2")], config, ScriptedBackend(scripts, config),
            FakeSandbox(), ChatFormat(CharTokenizer(), box.schemas), write=write, reward_fn=fake_reward,
            progress=False, toolbox=box)
    assert sorted(finished[:3]) == ["it0-free0-s0", "it0-free1-s0", "it0-free2-s0"] and finished[3] == "it0-waits-s0"
    (gate,) = [s for s in segments if s.rollout_id == "it0-waits-s0" and s.kind == "tool"]
    assert gate.text == tool_response_text("Tool call success\nopen")
    box.close()


def test_a_tool_keeps_state_per_rollout_and_its_release_is_the_rollouts_tool_reward():
    """cleaner's own protocol has verl's per-trajectory life: create (with the row's create_kwargs)
    before a rollout's first call, calls that see the rollout, release at its end with a reward."""
    class Counter(Tool):
        name, description = "count", "Count."
        parameters = {"type": "object", "properties": {}}

        def __init__(self):
            super().__init__()
            self.counts, self.log = {}, []

        def create(self, context):
            self.counts[context.rollout_id] = context.create_kwargs("count").get("start", 0)
            self.log.append(("create", context.rollout_id))

        def call_in(self, arguments, context):
            self.counts[context.rollout_id] += 1
            return str(self.counts[context.rollout_id])

        def release(self, rollout_id):
            self.log.append(("release", rollout_id))
            return self.counts.pop(rollout_id)

    counter = Counter()
    box = Toolbox([counter])
    chat = ChatFormat(CharTokenizer(), box.schemas)
    count = "Count." + format_tool_call("count", {})
    scripts = {(p, 0): [count, count, answer("42")] for p in ("a", "b")}
    tasks = [dataclasses.replace(task(p), extra_info={"tools_kwargs": {"count": {"create_kwargs": {"start": start}}}})
             for p, start in (("a", 10), ("b", 0))]
    seen = []

    def judge(data_source, solution_str, ground_truth, extra_info):
        seen.append(extra_info["rollout_reward_scores"])
        return 1.0

    config = dataclasses.replace(BASE, max_concurrent_rollouts=1)
    parts = collect_parts(tasks, config, ScriptedBackend(scripts, config), FakeSandbox(), chat, reward_fn=fake_reward,
                          progress=False, toolbox=box, reward_file=RewardFunction("judge.py:judge", judge))
    texts = [s.text for part in parts for s in part.segments if s.kind == "tool"]
    assert texts == [tool_response_text(format_tool_text(True, n)) for n in ("11", "12", "1", "2")]
    assert counter.log == [("create", "it0-a-s0"), ("release", "it0-a-s0"), ("create", "it0-b-s0"),
                           ("release", "it0-b-s0")]
    assert seen == [{"count": 12.0}, {"count": 2.0}] and counter.counts == {}


def test_an_async_call_in_is_awaited_on_the_toolbox_loop():
    """A tool that writes its own call_in as a coroutine, with no call of its own."""
    class Echo(Tool):
        name, description = "echo", "Echo."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

        async def call_in(self, arguments, context):
            await asyncio.sleep(0)
            return f"{context.rollout_id}: {arguments['text']}"

    box = Toolbox([Echo()])
    try:
        done = asyncio.run(box.run("echo", {"text": "hi"}, CallContext("it0-p-s0")))
    finally:
        box.close()
    assert (done.status, done.text) == ("ok", "it0-p-s0: hi")
