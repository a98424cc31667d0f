"""verl tools as they are (cleaner/tools/verl.py): a BaseTool subclass from a verl tool config, run
per call as verl runs it, and the reference's own code-judge tool, unchanged, against a code-judge
service faked on 127.0.0.1.

Where verl is not installed (CI), `tests/fixtures/verl_stub` stands in for its tool interface; in
the environment of tools/verl-reference/setup.sh the same tests run against the reference's verl,
and verl's own gsm8k tool config runs too (CLEANER_REFERENCE names the checkout).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import Task
from cleaner.engine.grading.reward_file import RewardFunction
from cleaner.engine.model.chat import ChatFormat, format_tool_call, tool_response_text
from cleaner.errors import CollectionStopped
from cleaner.plugins import PluginError
from cleaner.tools import CallContext, Toolbox, ToolError, load_tools
from cleaner.tools import toolbox as toolbox_module
from cleaner.tools.verl import FORMAT_TEXT
from tests.agent_fakes import (
    BASE,
    CharTokenizer,
    FakeSandbox,
    ScriptedBackend,
    answer,
    collect_parts,
    fake_reward,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = FIXTURES / "open_cleaner"


REAL_VERL = importlib.util.find_spec("verl") is not None  # tools/verl-reference/setup.sh's environment


@pytest.fixture
def verl(monkeypatch):
    """verl's tool interface on the path (the stand-in where verl is not installed), and no module
    of the tools left behind."""
    if not REAL_VERL:
        monkeypatch.syspath_prepend(str(FIXTURES / "verl_stub"))
    else:
        monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    gone = ("recipe", "lookup_tool", "broken_tool") + (() if REAL_VERL else ("verl",))
    for name in [name for name in sys.modules if name.split(".")[0] in gone]:
        del sys.modules[name]


LOOKUP = '''
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

LOG = []


class Lookup(BaseTool):
    """Answers from the row's own table (create_kwargs), as verl's per-trajectory tools keep state."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.tables = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        self.tables[instance_id] = dict(kwargs["create_kwargs"].get("table", {}).items())
        self.asked = getattr(self, "asked", {})
        LOG.append(("create", instance_id, kwargs["create_kwargs"]))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        LOG.append(("execute", instance_id, parameters))
        key = parameters["key"]
        self.asked.setdefault(instance_id, set()).add(key)
        if key == "down":
            raise ConnectionError("connection refused")
        if key == "nested":
            return ToolResponse(text=parameters["no such argument"]), 0.0, {}
        if key == "number":
            return ToolResponse(text=str(int(parameters["key"]))), 0.0, {}
        if key == "long":
            return ToolResponse(text="Tool call success\\n" + "x" * 5000 + "end"), 0.0, {}
        if key == "bad reward":
            return ToolResponse(text="Tool call success"), "high", {}
        table = self.tables[instance_id]
        if key in table:
            return ToolResponse(text=f"Tool call success\\n{key} = {table[key]}"), 0.5, {}
        return ToolResponse(text=f"Tool call failure\\nNameError: {key} is not in the table"), -0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        LOG.append(("calc_reward", instance_id))
        return float(sum(key in self.tables[instance_id] for key in self.asked.get(instance_id, ())))

    async def release(self, instance_id, **kwargs):
        LOG.append(("release", instance_id))
        del self.tables[instance_id]
'''

SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."}},
                   "required": ["key"]}}}


def lookup_yaml(tmp_path: Path, config: str = "{}") -> Path:
    (tmp_path / "lookup_tool.py").write_text(LOOKUP)
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(f"""\
        tools:
          - class_name: lookup_tool.Lookup
            config: {config}
            tool_schema: {json.dumps(SCHEMA)}
        """))
    return path


def run(box: Toolbox, name: str, arguments: dict, context: CallContext):
    return asyncio.run(box.run(name, arguments, context))


def test_a_verl_tool_lives_per_rollout_with_the_rows_create_kwargs(verl, tmp_path, monkeypatch):
    """As verl's SGLang rollout drives a tool: one instance per rollout, created before its first
    call with the row's create_kwargs, executed per call, rewarded and released at its end."""
    monkeypatch.chdir(tmp_path)  # `lookup_tool.Lookup` is found from the working directory, as verl finds it
    monkeypatch.setattr(toolbox_module, "INFRA_BACKOFF_S", 0.0)
    (tool,) = load_tools(str(lookup_yaml(tmp_path)), None)
    assert (tool.name, tool.parameters, tool.verbatim, tool.lifetime) == (
        "lookup", SCHEMA["function"]["parameters"], True, "rollout")
    box = Toolbox([tool])
    log = sys.modules["lookup_tool"].LOG
    row = CallContext("it0-p-s0", {"lookup": {"create_kwargs": {"table": {"x": 7}}}})
    found = run(box, "lookup", {"key": "x"}, row)
    assert (found.status, found.error_type, found.text, found.verbatim, found.reward) == (
        "ok", None, "Tool call success\nx = 7", True, 0.5)
    missing = run(box, "lookup", {"key": "y"}, row)
    assert (missing.status, missing.error_type, missing.text, missing.reward) == (
        "error", "NameError", "Tool call failure\nNameError: y is not in the table", -0.25)
    wrong = run(box, "lookup", {"key": "nested"}, row)  # a KeyError in the tool: verl's format answer
    assert (wrong.status, wrong.error_type, wrong.text) == ("error", "KeyError", FORMAT_TEXT)
    value = run(box, "lookup", {"key": "number"}, row)  # a ValueError: the reference's plain failure
    assert (value.status, value.error_type, value.text) == ("error", "ValueError", "Tool call failure.")
    long = run(box, "lookup", {"key": "long"}, row)  # as the tool wrote it: verl cuts only by --max-tool-response-chars
    assert (long.status, len(long.text), long.text[-3:]) == ("ok", 5021, "end") and box.max_output_chars < 5021
    down = run(box, "lookup", {"key": "down"}, row)  # the service's fault: tried again, then infra_error
    assert (down.status, down.error_type, down.text) == (
        "infra_error", "ToolUnavailable", "the tool's service failed: ConnectionError: connection refused")
    other_row = run(box, "lookup", {"key": "x"}, CallContext("it0-q-s0", {}))  # its row has no table
    assert (other_row.status, other_row.error_type) == ("error", "NameError")
    with pytest.raises(ToolError, match=r"execute returned the step reward 'high'; verl's execute returns"):
        run(box, "lookup", {"key": "bad reward"}, row)
    assert asyncio.run(box.finish("it0-p-s0")) == {"lookup": 1.0}  # calc_reward: one key found
    assert asyncio.run(box.finish("it0-q-s0")) == {"lookup": 0.0} and asyncio.run(box.finish("it0-q-s0")) == {}
    box.close()
    p, q = (next(entry[1] for entry in log if entry[0] == "create" and entry[2] == kwargs)
            for kwargs in ({"table": {"x": 7}}, {}))
    tries = toolbox_module.INFRA_TRIES
    assert log == [("create", p, {"table": {"x": 7}}), ("execute", p, {"key": "x"}), ("execute", p, {"key": "y"}),
                   ("execute", p, {"key": "nested"}), ("execute", p, {"key": "number"}), ("execute", p, {"key": "long"})
                   ] + [("execute", p, {"key": "down"})] * tries + [
                   ("create", q, {}), ("execute", q, {"key": "x"}), ("execute", p, {"key": "bad reward"}),
                   ("calc_reward", p), ("release", p), ("calc_reward", q), ("release", q)]


def test_lifetime_call_runs_each_call_as_the_references_agent_loop(verl, tmp_path, monkeypatch):
    """verl's ToolAgentLoop (the reference's): create, execute and release per call, no calc_reward."""
    monkeypatch.chdir(tmp_path)
    (tool,) = load_tools(str(lookup_yaml(tmp_path, "{lifetime: call}")), None)
    box = Toolbox([tool])
    row = CallContext("it0-p-s0", {"lookup": {"create_kwargs": {"table": {"x": 7}}}})
    assert [run(box, "lookup", {"key": key}, row).status for key in ("x", "nested", "y")] == ["ok", "error", "error"]
    assert asyncio.run(box.finish("it0-p-s0")) == {}
    box.close()
    log = sys.modules["lookup_tool"].LOG
    assert [entry[0] for entry in log] == ["create", "execute", "release"] * 3
    assert len({entry[1] for entry in log}) == 3  # an instance per call, released whatever happened
    with pytest.raises(ToolError, match=r"lifetime must be one of rollout, call, got 'episode'"):
        load_tools(str(lookup_yaml(tmp_path, "{lifetime: episode}")), None)


def test_a_rollout_that_ends_on_a_fault_releases_its_tools(verl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    box = Toolbox(load_tools(str(lookup_yaml(tmp_path)), None))
    run(box, "lookup", {"key": "x"}, CallContext("it0-p-s0", {}))
    box.abandon("it0-p-s0")  # what the agent loop does when the rollout raises (a backend fault, a stop)
    box.close()  # after the release it queued
    assert [entry[0] for entry in sys.modules["lookup_tool"].LOG] == ["create", "execute", "calc_reward", "release"]
    assert box.live == {}


def test_a_rollout_a_backend_fault_ends_releases_its_tools_through_the_agent_loop(verl, tmp_path, monkeypatch):
    """The backend fails rollout p's turn after its call (InfraFault): p is not stored, and its verl
    tool is given calc_reward and release all the same; q, beside it, is stored."""
    monkeypatch.chdir(tmp_path)
    box = Toolbox(load_tools(str(lookup_yaml(tmp_path)), None))
    chat = ChatFormat(CharTokenizer(), box.schemas)
    scripts = {("p", 0): ["Look." + format_tool_call("lookup", {"key": "x"}), answer("7")], ("q", 0): [answer("7")]}
    kwargs = {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"x": 7}}}}}
    tasks = [Task(p, ({"role": "user", "content": "x?"},), "7", "toy", extra_info=kwargs) for p in ("p", "q")]
    parts = []
    with pytest.raises(CollectionStopped, match=r"^1 of 2 rollouts were not collected: the backend failed their "):
        collect(tasks, BASE, ScriptedBackend(scripts, BASE, raise_on={("p", 0, 1)}), FakeSandbox(), chat,
                write=parts.append, reward_fn=fake_reward, progress=False, toolbox=box)
    box.close()  # after the release the agent loop queued
    assert [r.rollout_id for part in parts for r in part.rollouts] == ["it0-q-s0"]
    log = sys.modules["lookup_tool"].LOG
    assert [entry[0] for entry in log] == ["create", "execute", "calc_reward", "release"]
    assert box.live == {}


def test_a_bad_create_kwargs_is_one_line_never_the_models_failure(verl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    box = Toolbox(load_tools(str(lookup_yaml(tmp_path)), None))
    try:
        with pytest.raises(ToolError, match=r"^tool 'lookup' \(lookup_tool.Lookup\): create raised AttributeError: "
                                            r".* on rollout it0-p-s0; it reads the row's extra_info.tools_kwargs."
                                            r"lookup.create_kwargs, which has \['table'\]$"):
            run(box, "lookup", {"key": "x"}, CallContext("it0-p-s0", {"lookup": {"create_kwargs": {"table": 7}}}))
    finally:
        box.close()


def test_success_is_read_from_the_text_as_the_reference_reads_it(verl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tool,) = load_tools(str(lookup_yaml(tmp_path)), None)
    assert [tool.failure(text) for text in (
        "", "Tool call success\nstdout: 1", "Tool call failure\nreason: error\nstderr: ZeroDivisionError: x",
        "Tool call failure\nstderr: NameError, then a TypeError", "Tool call failure.")] == [
        None, None, "ZeroDivisionError", "NameError", "unknown_error"]  # the first pattern in the reference's order
    (plain,) = load_tools(str(lookup_yaml(tmp_path, "{success_marker: null, timeout_s: 2}")), None)
    assert plain.failure("Tool call failure") is None and plain.timeout_s == 2.0


def test_a_verl_tool_in_a_collection_answers_verbatim_and_its_rewards_reach_the_reward_function(verl, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    box = Toolbox(load_tools(str(lookup_yaml(tmp_path)), None))
    chat = ChatFormat(CharTokenizer(), box.schemas)
    scripts = {("p", 0): ["Look." + format_tool_call("lookup", {"key": "z"}),
                          "Again." + format_tool_call("lookup", {"key": "x"}), answer("7")]}
    tasks = [Task("p", ({"role": "user", "content": "x?"},), "7", "toy",
                  extra_info={"index": 3, "tools_kwargs": {"lookup": {"create_kwargs": {"table": {"x": 7}}}}})]
    seen = []

    def judge(data_source, solution_str, ground_truth, extra_info):
        seen.append(extra_info)
        return 1.0

    parts = collect_parts(tasks, BASE, ScriptedBackend(scripts, BASE), FakeSandbox(), chat, reward_fn=fake_reward,
                          progress=False, toolbox=box, reward_file=RewardFunction("judge.py:judge", judge))
    box.close()
    tools = [s for part in parts for s in part.segments if s.kind == "tool"]
    assert [(s.tool_name, s.tool_status, s.error_type) for s in tools] == [
        ("lookup", "error", "NameError"), ("lookup", "ok", None)]
    assert [s.text for s in tools] == [chat.decode(chat.tool_response_ids(text)) for text in (
        "Tool call failure\nNameError: z is not in the table", "Tool call success\nx = 7")]
    assert tools[1].text == tool_response_text("Tool call success\nx = 7")  # no wording of cleaner's around it
    (extra,) = seen  # calc_reward's 1.0 (one key found), execute's step rewards in call order
    assert (extra["rollout_reward_scores"], extra["tool_rewards"], extra["index"]) == ({"lookup": 1.0}, [-0.25, 0.5], 3)
    log = sys.modules["lookup_tool"].LOG
    assert [entry[0] for entry in log] == ["create", "execute", "execute", "calc_reward", "release"]


def test_a_verl_tool_that_cannot_start_or_load_is_one_line(verl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_tool.py").write_text(
        "from verl.tools.base_tool import BaseTool\n"
        "class Broken(BaseTool):\n"
        "    def __init__(self, config, tool_schema):\n"
        "        raise OSError('no code judge configured')\n")
    yaml = tmp_path / "broken.yaml"
    yaml.write_text(f"tools:\n  - class_name: broken_tool.Broken\n    tool_schema: {json.dumps(SCHEMA)}\n")
    with pytest.raises(ToolError, match=r"^tool 'broken_tool.Broken': creating it raised OSError: no code judge "
                                        r"configured$"):
        Toolbox(load_tools(str(yaml), None))
    yaml.write_text("tools:\n  - class_name: broken_tool.Broken\n")
    with pytest.raises(ToolError, match=r"a verl tool takes its name and parameters from the entry's `tool_schema`"):
        load_tools(str(yaml), None)


@pytest.mark.skipif(REAL_VERL, reason="verl is installed here")
def test_a_missing_verl_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_verl.py").write_text("from verl.tools.base_tool import BaseTool\n")
    with pytest.raises(PluginError) as raised:
        load_tools(None, f"{tmp_path}/needs_verl.py:BaseTool")
    assert str(raised.value).endswith("ModuleNotFoundError: No module named 'verl'; it is a verl tool or reward and "
                                      "verl is not installed: see docs/byo-task.md#verl-tools-as-they-are")


# ---------------------------------------------------------------------------------------------
# The reference's code-judge tool, unchanged, against a code judge faked here


class CodeJudge(BaseHTTPRequestHandler):
    """The code-judge service's /run/long-batch: each submission run as a Python program on its input."""

    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/run/long-batch" and body["type"] == "batch"
        type(self).requests.append(body)
        results = []
        for submission in body["submissions"]:
            assert submission["type"] == "python"
            done = subprocess.run([sys.executable, "-c", submission["solution"]], input=submission["input"] or "",
                                  capture_output=True, text=True, timeout=30)
            ok = done.returncode == 0
            results.append({"run_success": ok, "success": ok, "reason": "success" if ok else "runtime_error",
                            "stdout": done.stdout, "stderr": done.stderr})
        payload = json.dumps({"results": results}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def code_judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), CodeJudge)
    CodeJudge.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def reference_yaml(tmp_path: Path, port: int) -> Path:
    """The reference's tool config as it is, but for the port of the judge faked here."""
    text = (REFERENCE / "recipe" / "cleaner" / "rstar_code_judge.yaml").read_text()
    assert 'host_port: "8088"' in text
    path = tmp_path / "rstar_code_judge.yaml"
    path.write_text(text.replace('host_port: "8088"', f'host_port: "{port}"'))
    return path


def test_the_references_code_judge_tool_runs_unchanged(verl, tmp_path, monkeypatch, code_judge):
    monkeypatch.chdir(REFERENCE)  # the reference's checkout: `recipe.cleaner.code_judge_tool` is found from it
    (tool,) = load_tools(str(reference_yaml(tmp_path, code_judge)), None)
    assert type(tool).__name__ == "VerlTool" and tool.cls.__module__ == "recipe.cleaner.code_judge_tool"
    box = Toolbox([tool])  # the code_interpreter of its config takes the built-in one's place
    assert [schema["function"]["name"] for schema in box.schemas] == ["code_interpreter"]
    assert box.schemas[0]["function"]["description"] == "A tool for executing code."
    try:
        context = CallContext("it0-p-s0", {})
        ok = run(box, "code_interpreter", {"code": "print(6 * 7)"}, context)
        failed = run(box, "code_interpreter", {"code": "print(1 / 0)"}, context)
        reads = run(box, "code_interpreter", {"code": "print(int(input()) + 1)", "input": "41\n"}, context)
        scores = asyncio.run(box.finish(context.rollout_id))
    finally:
        box.close()
    assert (ok.status, ok.error_type, ok.text, ok.verbatim) == ("ok", None, "Tool call success\nstdout: 42\n", True)
    assert (failed.status, failed.error_type, failed.text) == ("error", "ZeroDivisionError", (
        "Tool call failure\nreason: runtime_error\nstderr: ZeroDivisionError at line 1: division by zero\n"
        "  print(1 / 0)\n"))  # the reference's template reports the model's line
    assert (reads.status, reads.text) == ("ok", "Tool call success\nstdout: 42\n")
    assert scores == {"code_interpreter": []}  # its calc_reward's value, passed on as verl passes it
    # the code the tool sent is the reference's template around the model's code, base64 inside
    solutions = [body["submissions"][0]["solution"] for body in CodeJudge.requests]
    assert base64.b64encode(b"print(6 * 7)").decode() in solutions[0]


def test_the_code_judge_down_is_an_infrastructure_fault_never_the_models(verl, tmp_path, monkeypatch):
    """The reference's tool retries a refused connection 4 times (7.5 s of backoff), then raises:
    stored as infra_error, which purify never trains; the reference trains it as a failed call."""
    monkeypatch.chdir(REFERENCE)
    monkeypatch.setattr(toolbox_module, "INFRA_TRIES", 1)
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    box = Toolbox(load_tools(str(reference_yaml(tmp_path, port)), None))
    try:
        down = run(box, "code_interpreter", {"code": "print(1)"}, CallContext())
    finally:
        box.close()
    assert (down.status, down.error_type) == ("infra_error", "ToolUnavailable")
    assert down.text.startswith("the tool's service failed: RuntimeError: run_tool_calls_on_server_async failed")


@pytest.mark.skipif(not (REAL_VERL and os.environ.get("CLEANER_REFERENCE")),
                    reason="needs verl and CLEANER_REFERENCE (tools/verl-reference/setup.sh)")
def test_verls_gsm8k_tool_keeps_its_state_per_rollout(verl, tmp_path):
    """verl's example tool, from its own config: the row's ground truth by create_kwargs, a step
    penalty for an answer that does not improve (state across the rollout's calls), calc_reward at
    the end. Its answers carry no success marker, so the config says `success_marker: null`."""
    example = Path(os.environ["CLEANER_REFERENCE"]) / "verl/examples/sglang_multiturn/config/tool_config"
    text = (example / "gsm8k_tool_config.yaml").read_text()
    assert "      type: native\n" in text
    yaml = tmp_path / "gsm8k.yaml"
    yaml.write_text(text.replace("      type: native\n", "      type: native\n      success_marker: null\n"))
    box = Toolbox(load_tools(str(yaml), None))
    row = CallContext("it0-gsm8k-7-s0", {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
    try:
        answers = [run(box, "calc_gsm8k_reward", {"answer": answer}, row) for answer in ("70", "72", "72")]
        scores = asyncio.run(box.finish(row.rollout_id))
    finally:
        box.close()
    assert [(a.status, a.text, a.reward) for a in answers] == [
        ("ok", "Current parsed answer='70' reward=0.0", -0.05),  # not better than 0.0: verl's penalty
        ("ok", "Current parsed answer='72' reward=1.0", 0.0),
        ("ok", "Current parsed answer='72' reward=1.0", -0.05)]
    assert scores == {"calc_gsm8k_reward": 1.0}
