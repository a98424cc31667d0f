"""The tool-call parser on hostile text: it never raises, and what it returns is valid text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cleaner.engine.model.chat import (
    MAX_REPAIR_WORK,
    ToolCall,
    bracket_depth,
    format_call,
    parse_tool_call,
)
from cleaner.tools.responses import valid_text

OPEN_CALL = '{"name": "code_interpreter", "arguments": {"code": "'


def call(body: str) -> str:
    return f"Let me compute.<tool_call>\n{body}\n</tool_call>"


def ok(code: str) -> ToolCall:
    """A readable call of the code interpreter."""
    return ToolCall(code, None, "code_interpreter", {"code": code})


@pytest.mark.parametrize("kind", "[{(")
@pytest.mark.parametrize("depth", [340, 1000, 100_000])
def test_deep_unclosed_brackets_are_a_format_error(kind, depth):
    assert parse_tool_call(call(kind * depth)) == ToolCall(None, (
        f"the call is not valid JSON, and too big to repair ({depth:,} characters, brackets nested {depth:,} deep)"))
    body = OPEN_CALL + kind * depth  # inside a string that never ends
    assert parse_tool_call(call(body)) == ToolCall(None, (
        f"the call is not valid JSON, and too big to repair ({len(body):,} characters, brackets nested "
        f"{depth + 2:,} deep)"))


@pytest.mark.parametrize("kind", "[{(")
@pytest.mark.parametrize("depth", [340, 1000, 100_000])
def test_deep_brackets_inside_a_valid_string_are_code(kind, depth):
    assert parse_tool_call(format_call(kind * depth)) == ok(kind * depth)


def test_valid_json_too_deep_for_the_json_module_is_a_format_error():
    body = "[" * 5000 + "]" * 5000  # valid, but json.loads gives up (RecursionError)
    assert parse_tool_call(call(body)).error == (
        "the call is not valid JSON, and too big to repair (10,000 characters, brackets nested 5,000 deep)")


def test_repair_is_bounded_by_length_times_depth():
    # An unterminated code string at a call's depth of 2: repaired up to 50,000 characters.
    fits = OPEN_CALL + "a" * (MAX_REPAIR_WORK // 2 - len(OPEN_CALL))
    assert parse_tool_call(call(fits)) == ok("a" * (MAX_REPAIR_WORK // 2 - len(OPEN_CALL)))
    assert parse_tool_call(call(fits + "a")).error == (
        "the call is not valid JSON, and too big to repair (50,001 characters, brackets nested 2 deep)")
    # a valid call is read whatever its size
    assert parse_tool_call(format_call("a" * 10 * MAX_REPAIR_WORK)).code == "a" * 10 * MAX_REPAIR_WORK


def test_double_encoded_arguments_are_bounded_too():
    body = json.dumps({"name": "code_interpreter", "arguments": "[" * 1000})
    assert parse_tool_call(call(body)).error == (
        "the arguments string is not valid JSON, and too big to repair (1,000 characters, brackets nested "
        "1,000 deep)")
    body = json.dumps({"name": "code_interpreter", "arguments": json.dumps({"code": "print(1)"})})
    assert parse_tool_call(call(body)) == ok("print(1)")


def test_an_escaped_lone_surrogate_in_the_code_is_a_format_error():
    assert parse_tool_call(call(OPEN_CALL + "print('\\udcff')\"}}")) == ToolCall(None, (
        "the code is not valid text: character 7 is the lone surrogate '\\udcff', which UTF-8 cannot encode"),
        "code_interpreter")
    # an escaped backslash is no surrogate: Python reads the escape when the code runs
    assert parse_tool_call(format_call("print('\\udcff')")) == ok("print('\\udcff')")
    # a surrogate pair is one valid character
    assert parse_tool_call(call(OPEN_CALL + "print('\\ud83d\\ude00')\"}}")).code == "print('\U0001f600')"


def test_a_huge_or_deep_tool_name_is_quoted_short():
    error = parse_tool_call(call(json.dumps({"name": "x" * 10**6}))).error
    assert error == f"unknown tool '{'x' * 37}...{'x' * 38}'; the only tool is code_interpreter"
    nested = "[" * 900 + "]" * 900  # json reads it; a plain repr of it would recurse 900 deep
    assert parse_tool_call(call('{"name": ' + nested + "}")).error == (
        "unknown tool [[[...]]]; the only tool is code_interpreter")


def test_a_number_of_too_many_digits_is_no_exception():
    # json.loads raises ValueError (not JSONDecodeError) past 4,300 digits; the repair reads it as text
    assert parse_tool_call(call(OPEN_CALL[:-1] + "1" * 5000 + "}}")).code == "1" * 5000


def test_bracket_depth_counts_every_bracket_and_never_goes_below_zero():
    assert [bracket_depth(text) for text in ("", "abc", "([{", "(a)(b)", "))((", '"[[["', "{[}]("
                                            )] == [0, 0, 3, 1, 2, 3, 2]


def test_valid_text_escapes_lone_surrogates_and_keeps_the_rest():
    text = "ok \x1b[31m\x00\r\ufffd\U0001f600"
    assert valid_text(text) is text
    assert valid_text("a\udcffb\ud800") == "a\\udcffb\\ud800"


HOSTILE_CHARS = st.sampled_from(list('{}[]()":,\\\' ab1') + ["\\u", "\\udcff", "\udcff", "\x00", "\x1b",
                                                            "<tool_call>", "</tool_call>", OPEN_CALL])


@settings(max_examples=300, deadline=None)
@given(st.lists(HOSTILE_CHARS, max_size=300).map("".join))
def test_no_text_makes_the_parser_raise_or_return_invalid_text(text):
    parsed = parse_tool_call("<tool_call>" + text)
    assert isinstance(parsed, ToolCall) and (parsed.code is None) != (parsed.error is None)
    (parsed.error if parsed.code is None else parsed.code).encode("utf-8")  # valid: tokenizers and Parquet take it
