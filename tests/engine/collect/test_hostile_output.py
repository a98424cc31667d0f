"""Hostile model output through the real agent loop, sandbox and warehouse (docs/architecture.md §5).

A small model early in RL writes degenerate text: thousands of unclosed brackets, strings that never
end, escapes of lone surrogates, terminal control sequences, calls of a megabyte, calls that never
close. None of it may end a collection. Each case below is one prompt of ONE batch that
`collect_job` collects with the real sandbox into a real warehouse; its test reads back what was
stored: the hostile call's tool row (status, error type, code, the text the model saw), and the
model's next turn, which answers, so every rollout ends with `answer`.

The backend is scripted: the tiny policy's real tokenizer (byte-level BPE) encodes each turn's
text, and the request whose seed is the loop's `turn_seed(prompt, sample, turn)` gets that turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.collect.agent import turn_seed
from cleaner.engine.collect.job import CollectRequest, collect_job
from cleaner.engine.model.base import LENGTH, STOP, Generation
from cleaner.engine.model.chat import format_call
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse
from tests.factories import RequestsOverBatch

SOURCE = "hostile"
ANSWER = "So the answer is \\boxed{42}.<|im_end|>"
OPEN_CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "'
MEGABYTE = 2**20
# About 3.5 characters per token of the tiny policy's tokenizer: a 1 MB call is about 300,000 tokens.
MEGABYTE_OF_CODE = ("# " + "the " * 250 + "\n") * (MEGABYTE // 1003) + "print(6 * 7)"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_POLICY)


# ---------------------------------------------------------------------------------------------
# A scripted policy


class ScriptedBackend(RequestsOverBatch):
    """The request with the seed of (prompt, sample 0, turn t) writes script[prompt][t]: a text,
    encoded by the real tokenizer, or token ids as they are. Generation stops as a model's does: after
    a stop token (kept), or at max_new_tokens (LENGTH)."""

    policy_version = "scripted@1"
    context_length = None  # the script is no model: nothing to check prompts against

    def __init__(self, tokenizer, scripts: dict[str, list[str | tuple[int, ...]]], config: CollectConfig):
        self.tokenizer, self.model_path = tokenizer, Path(DEFAULT_POLICY)
        self.turns: dict[int, tuple[int, ...]] = {}
        for prompt_id, turns in scripts.items():
            for turn, script in enumerate(turns):
                ids = tuple(script) if isinstance(script, tuple) else tuple(tokenizer.encode(script))
                self.turns[turn_seed(config.seed, config.iteration, prompt_id, 0, turn)] = ids
        self.generated: list[tuple[int, ...]] = []

    def generate(self, prompts, params, seeds):
        return [self._one(self.turns[seed], params) for seed in seeds]

    def _one(self, ids: tuple[int, ...], params) -> Generation:
        stop = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
        if stop is not None and stop < params.max_new_tokens:
            ids, reason = ids[: stop + 1], STOP
        else:
            ids, reason = ids[: params.max_new_tokens], LENGTH
        self.generated.append(ids)
        return Generation(ids, (-0.5,) * len(ids), reason)

    def close(self) -> None:
        pass


def collect_scripts(tokenizer, root: Path, scripts: dict[str, list], **config_fields) -> tuple[Warehouse, ScriptedBackend]:
    """Collect one prompt per script (rows of a verl-layout file, prompt ids `hostile-<row>`), one
    sample each, into the warehouse at `root`."""
    data = root.parent / f"{root.name}.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"Case {index}: what is 6 * 7?"}],
             "reward_model": {"ground_truth": "42"}, "data_source": SOURCE} for index in range(len(scripts))]
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = CollectConfig(model=str(DEFAULT_POLICY), data=str(data), prompt_style="bare", n_prompts=len(rows),
                           group_size=1, max_turns=4, max_retries=3, batch_rollouts=len(rows),
                           sandbox=SandboxConfig(workers=2), **config_fields)
    backend = ScriptedBackend(tokenizer, scripts, config)
    warehouse = Warehouse(root)
    collect_job(warehouse, CollectRequest(config), backend=backend, progress=False)
    return warehouse, backend


# ---------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    name: str  # the behaviour, as the test id
    call: str | tuple[int, ...]  # the hostile turn: text, or token ids (built with the tokenizer)
    status: str  # the tool row's tool_status
    error_type: str | None
    code: str | None  # the tool row's tool_code: the code that ran, None if the call does not parse
    says: str  # in the text of the tool row (what the model saw)


def _brackets(kind: str, depth: int) -> list[Case]:
    brackets = kind * depth
    name = {"[": "square", "{": "curly", "(": "round"}[kind] + f"-{depth}"
    too_big = "is not valid JSON, and too big to repair"
    return [
        Case(f"unclosed-{name}-is-a-format-error", f"<tool_call>{brackets}</tool_call>",
             "format_error", "FormatError", None, too_big),
        Case(f"unclosed-{name}-in-an-unterminated-string-is-a-format-error",
             f"{OPEN_CALL}{brackets}</tool_call>", "format_error", "FormatError", None, too_big),
        # valid JSON whatever the depth: the code runs, and Python's parser refuses it
        Case(f"{name}-inside-a-valid-string-runs-and-fails", format_call(brackets), "error", "SyntaxError",
             brackets, "too many nested parentheses"),
    ]


def _cases(tokenizer) -> list[Case]:
    encoded_surrogate = tuple(tokenizer.convert_tokens_to_ids(["í", "³", "¿"]))  # bytes ED B3 BF
    # Code may write its own closing JSON to the child's result pipe (the highest fd it may open) and
    # close it: the sandbox then reports the forged error type and message.
    forge = (f"import os\nos.write({SandboxConfig().max_open_files - 1}, "
             "b'{\"error_type\": \"\\\\udcff\", \"error_text\": \"forged \\\\udcff\"}')\n"
             f"os.close({SandboxConfig().max_open_files - 1})")
    return [
        *(case for kind in "[{(" for depth in (340, 1000, 100_000) for case in _brackets(kind, depth)),
        Case("unterminated-string-is-repaired-and-run", f"{OPEN_CALL}print(6 * 7)</tool_call>", "ok", None,
             "print(6 * 7)", "stdout: 42"),
        Case("unterminated-megabyte-string-is-a-format-error",
             OPEN_CALL + MEGABYTE_OF_CODE.replace("\n", "\\n") + "</tool_call>", "format_error",
             "FormatError", None, "too big to repair (1,04"),
        Case("deep-double-encoded-arguments-are-a-format-error",
             '<tool_call>{"name": "code_interpreter", "arguments": "' + "[" * 1000 + '"}</tool_call>',
             "format_error", "FormatError", None, "the arguments string is not valid JSON"),
        Case("escaped-surrogate-in-the-code-is-a-format-error",
             OPEN_CALL + "print('\\udcff')\"}}\n</tool_call>", "format_error", "FormatError", None,
             "character 7 is the lone surrogate '\\udcff'"),
        Case("megabyte-tool-name-is-quoted-cut", '<tool_call>{"name": "' + "the " * (MEGABYTE // 4) + '"}</tool_call>',
             "format_error", "FormatError", None, "unknown tool 'the the the"),
        Case("printed-surrogate-is-stored-escaped", format_call("print('\\udcff')"), "ok", None,
             "print('\\udcff')", "stdout: \\udcff"),
        Case("surrogate-in-an-error-message-is-stored-escaped", format_call("raise ValueError(chr(0xdcff))"),
             "error", "ValueError", "raise ValueError(chr(0xdcff))", "ValueError at line 1: \\udcff"),
        Case("surrogate-in-a-forged-sandbox-result-is-stored-escaped", format_call(forge), "error", "\\udcff",
             forge, "forged \\udcff"),
        Case("invalid-utf8-printed-becomes-replacement-characters",
             format_call("import sys\nsys.stdout.buffer.write(b'\\xed\\xb3\\xbf\\xff!')\nsys.stdout.flush()"),
             "ok", None, "import sys\nsys.stdout.buffer.write(b'\\xed\\xb3\\xbf\\xff!')\nsys.stdout.flush()",
             "stdout: \ufffd\ufffd\ufffd\ufffd!"),
        Case("invalid-utf8-tokens-in-the-call-decode-to-replacement-characters",
             (*tokenizer.encode(OPEN_CALL + "print('"), *encoded_surrogate,
              *tokenizer.encode("')\"}}\n</tool_call>")),
             "ok", None, "print('\ufffd\ufffd\ufffd')", "stdout: \ufffd\ufffd\ufffd"),
        Case("control-characters-printed-are-kept", format_call("print('\\x1b[31mred\\x1b[0m\\x07\\x00\\r\\x08!')"),
             "ok", None, "print('\\x1b[31mred\\x1b[0m\\x07\\x00\\r\\x08!')",
             "stdout: \x1b[31mred\x1b[0m\x07\x00\r\x08!"),
        Case("control-characters-in-the-call-are-kept",
             "\x1b]0;title\x07\x1b[2J" + format_call("print('\x1b[1m', 6 * 7)"), "ok", None,
             "print('\x1b[1m', 6 * 7)", "stdout: \x1b[1m 42"),
        Case("megabyte-call-runs", format_call(MEGABYTE_OF_CODE), "ok", None, MEGABYTE_OF_CODE, "stdout: 42"),
    ]


@pytest.fixture(scope="module")
def hostile(tokenizer, tmp_path_factory):
    """The cases, collected in one batch: (cases by prompt id, warehouse, backend)."""
    cases = {f"{SOURCE}-{index}": case for index, case in enumerate(_cases(tokenizer))}
    scripts = {prompt_id: [case.call, ANSWER] for prompt_id, case in cases.items()}
    warehouse, backend = collect_scripts(tokenizer, tmp_path_factory.mktemp("hostile") / "warehouse", scripts,
                                         max_new_tokens=MEGABYTE, max_response_tokens=MEGABYTE)
    return cases, warehouse, backend


def _case_ids() -> list[str]:
    names = [case.name for case in _cases(AutoTokenizer.from_pretrained(DEFAULT_POLICY))]
    assert len(set(names)) == len(names), "each case names one behaviour"
    return names


# ---------------------------------------------------------------------------------------------
# What was stored


def test_every_rollout_of_the_hostile_batch_is_stored(hostile):
    cases, warehouse, backend = hostile
    rollouts = warehouse.read_rollouts(0)
    assert sorted(r.prompt_id for r in rollouts) == sorted(cases)
    assert len(list((warehouse.root / "rollouts" / "iteration=0").glob("part-*.parquet"))) == 1  # one batch
    assert {(r.finish_reason, r.correct, r.n_tool_calls) for r in rollouts} == {("answer", True, 1)}
    stored = sorted(s.token_ids for s in warehouse.read_segments(0) if s.kind == "assistant")
    assert stored == sorted(backend.generated)  # every token the model wrote, as it wrote it


@pytest.mark.parametrize("name", _case_ids())
def test_hostile_call(hostile, name):
    cases, warehouse, _ = hostile
    prompt_id, case = next((p, c) for p, c in cases.items() if c.name == name)
    (rollout,) = [r for r in warehouse.read_rollouts(0) if r.prompt_id == prompt_id]
    _, segments = warehouse.read_rollout(rollout.rollout_id)
    kinds = [(s.kind, s.step, s.attempt) for s in segments]
    failed = case.status != "ok"
    assert kinds == [("prompt", None, None), ("assistant", 0, 0), ("tool", 0, 0),
                     ("assistant", 0, 1) if failed else ("assistant", 1, 0)]
    call, tool = segments[1], segments[2]
    assert (tool.tool_status, tool.error_type, tool.tool_code) == (case.status, case.error_type, case.code)
    assert call.tool_code == case.code and call.call_start is not None
    assert case.says in tool.text
    assert case.status != "format_error" or len(tool.text) < 400  # nothing of a huge call is quoted back
    assert rollout.n_failed_calls == int(failed)
    for segment in segments:  # valid UTF-8 text; the token ids are the record
        for text in (segment.text, segment.tool_code, segment.error_type):
            assert text is None or text.encode("utf-8")


def test_the_warehouse_reads_back_through_cleaner_sql(hostile, tmp_path):
    cases, warehouse, _ = hostile
    out = tmp_path / "segments.json"
    query = "SELECT rollout_id, seq, text, tool_code, error_type FROM segments ORDER BY rollout_id, seq"
    result = CliRunner().invoke(app, ["sql", query, "-w", str(warehouse.root), "-f", "json", "-o", str(out)])
    assert result.exit_code == 0, result.output
    segments = sorted(warehouse.read_segments(0), key=lambda s: (s.rollout_id, s.seq))
    assert json.loads(out.read_text()) == [
        {"rollout_id": s.rollout_id, "seq": s.seq, "text": s.text, "tool_code": s.tool_code,
         "error_type": s.error_type} for s in segments]
    query = "SELECT tool_status, count(*) AS n FROM segments WHERE kind = 'tool' GROUP BY ALL ORDER BY ALL"
    result = CliRunner().invoke(app, ["sql", query, "-w", str(warehouse.root), "-f", "csv"])
    assert result.exit_code == 0, result.output
    statuses = [case.status for case in cases.values()]
    assert result.output.splitlines() == ["tool_status,n"] + [
        f"{status},{statuses.count(status)}" for status in sorted(set(statuses))]


def test_a_call_that_never_closes_is_a_format_error_until_the_budget_runs_out(tokenizer, tmp_path):
    never = 'Let me think.<tool_call>\n{"code": "' + "(" * 5000  # 64 tokens hold no </tool_call>
    warehouse, _ = collect_scripts(tokenizer, tmp_path / "warehouse", {f"{SOURCE}-0": [never] * 4},
                                   max_new_tokens=64, max_response_tokens=200, collect_view="raw")
    (rollout,) = warehouse.read_rollouts(0)
    _, segments = warehouse.read_rollout(rollout.rollout_id)
    assistants = [s for s in segments if s.kind == "assistant"]
    tools = [s for s in segments if s.kind == "tool"]
    # Each turn writes min(64, what the budget leaves) tokens, then gets the same error response.
    expected, used = [], 0
    while used < 200:
        expected.append(min(64, 200 - used))
        used += expected[-1] + len(tools[0].token_ids)
    assert len(expected) >= 2 and [len(s.token_ids) for s in assistants] == expected
    assert [(s.tool_status, s.error_type, s.attempt) for s in tools] == [
        ("format_error", "FormatError", attempt) for attempt in range(len(expected))]
    assert all("the call is not closed with </tool_call>" in s.text for s in tools)
    assert (rollout.finish_reason, rollout.n_failed_calls) == ("max_tokens", len(expected))
