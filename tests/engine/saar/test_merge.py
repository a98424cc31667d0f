"""SAAR's merge of one chain (cleaner/engine/saar/merge.py, docs/architecture.md §4) at the edges the
walk's tests leave: calls of different tools, a call that does not parse, two shallow merges in a
row, the IS gate in a chain that is not recovered, the negative samples of a recovered chain, and
the errors that name a malformed chain.

Builders and chains are tests/factories.py's: token ids are tiny integers, every assistant token's
behaviour log-prob is -id / 1000. Each expected value is worked out by hand in its comment.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from cleaner.engine.saar.merge import Span, _cut_origin, span_of
from cleaner.engine.saar.walk import (
    RAW,
    KeptTokens,
    MergeDecision,
    NegativeSample,
    Outcome,
    RenderSettings,
    explain,
    render,
)
from cleaner.records import ToolStatus
from cleaner.tools.responses import TOOL_NAME
from tests.factories import (
    TableOracle,
    answered_chain,
    assistant,
    exhausted_chain,
    lp,
    prompt,
    tool,
)
from tests.helpers import assert_rendered

PURIFIED = RenderSettings(purified=True, gamma=0.5, similarity_on="code")
BY_CALL = RenderSettings(purified=True, gamma=0.5, similarity_on="call")


def gated(tau: float) -> RenderSettings:
    return RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=tau)


def named(segment, tool_name: str | None):
    return dataclasses.replace(segment, tool_name=tool_name)


def spaced(token_ids) -> str:
    """A decode for tiny integer ids: "11 12" for (11, 12)."""
    return " ".join(str(i) for i in token_ids)


# ----------------------------------------------------------------------------------------------
# Spans and their provenance


def test_a_span_is_its_segment_with_context_logprobs_zero_and_the_interpreter_unnamed():
    assert span_of(tool(2, 0, 0, (14, 15), ToolStatus.ERROR)) == Span(
        (14, 15), (0.0, 0.0), trained=False, origin=(KeptTokens(2, 0, 2),))
    call = assistant(1, 0, 0, (10,), (11, 12), code="print(1)")
    # the code interpreter is None, as an older part that stores no tool name; a user tool keeps its name
    assert span_of(named(call, TOOL_NAME)) == span_of(call) == Span(
        (10, 11, 12), (lp(10), lp(11), lp(12)), True, call_start=1, code="print(1)",
        origin=(KeptTokens(1, 0, 3),), tool=None)
    assert span_of(named(call, "search")).tool == "search"


def test_cutting_a_spliced_span_keeps_the_raw_ranges_of_the_tokens_cut():
    # 6 tokens: seq 1's [0, 2), seq 3's [1, 4), seq 5's [0, 1), at offsets 0, 2 and 5
    origin = (KeptTokens(1, 0, 2), KeptTokens(3, 1, 4), KeptTokens(5, 0, 1))
    assert _cut_origin(origin, 1, 3) == (KeptTokens(1, 1, 2), KeptTokens(3, 1, 2))
    assert _cut_origin(origin, 2, 6) == (KeptTokens(3, 1, 4), KeptTokens(5, 0, 1))  # seq 1 ends at 2: no empty piece
    assert _cut_origin(origin, 4, 6) == (KeptTokens(3, 3, 4), KeptTokens(5, 0, 1))
    assert _cut_origin(origin, 0, 0) == ()


def test_an_assistant_segment_without_logprobs_is_named():
    segments = [prompt(0, (1,)), dataclasses.replace(assistant(1, 0, 0, (10,)), logprobs=None)]
    with pytest.raises(ValueError, match=re.escape("assistant segment r#1 has no logprobs")):
        render(segments, RAW)


# ----------------------------------------------------------------------------------------------
# Which tool a call names


ARGUMENTS = '{"q": "1+1"}'


def two_tools_chain() -> list:
    """a_0 calls `search`, its retry `calc`, with the same arguments and the same call tokens."""
    return [
        prompt(0, (1,)),
        named(assistant(1, 0, 0, (10,), (11, 12), code=ARGUMENTS), "search"),
        tool(2, 0, 0, (13,), ToolStatus.ERROR),
        named(assistant(3, 0, 1, (20,), (11, 12), code=ARGUMENTS), "calc"),
        tool(4, 0, 1, (23,), ToolStatus.OK),
    ]


def test_by_code_calls_of_two_tools_are_unlike_and_by_call_their_tokens_decide():
    by_code = render(two_tools_chain(), PURIFIED)  # different tools: similarity 0, deep
    assert_rendered(by_code, ((1,), False), ((20, 11, 12), True), ((23,), False))
    assert explain(two_tools_chain(), PURIFIED)[0].merges == (MergeDecision(1, 0.0, "deep"),)
    by_call = render(two_tools_chain(), BY_CALL, spaced)  # "11 12" vs "11 12": ratio 1, shallow
    assert_rendered(by_call, ((1,), False), ((10, 11, 12), True), ((23,), False))
    assert explain(two_tools_chain(), BY_CALL, spaced)[0].merges == (MergeDecision(1, 1.0, "shallow"),)


def test_a_call_that_does_not_parse_and_a_code_interpreter_call_are_one_tool():
    # a_0's call does not parse: no tool name, no code. Its retry names the code interpreter. Same
    # tool, so by code the call tokens decide: "11 12" vs "11 12 13", ratio 2 * 5 / 13.
    segments = [
        prompt(0, (1,)),
        assistant(1, 0, 0, (10,), (11, 12)),
        tool(2, 0, 0, (14,), ToolStatus.FORMAT_ERROR),
        named(assistant(3, 0, 1, (20,), (11, 12, 13), code="print(1+1)"), TOOL_NAME),
        tool(4, 0, 1, (23,), ToolStatus.OK),
    ]
    assert_rendered(render(segments, PURIFIED, spaced), ((1,), False), ((10, 11, 12, 13), True), ((23,), False))
    assert explain(segments, PURIFIED, spaced)[0].merges == (MergeDecision(1, pytest.approx(10 / 13), "shallow"),)


def test_comparing_by_tokens_without_a_decode_says_what_it_needs():
    segments = [prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,)), tool(2, 0, 0, (12,), ToolStatus.FORMAT_ERROR),
                assistant(3, 0, 1, (20,), (21,), code="x"), tool(4, 0, 1, (22,), ToolStatus.OK)]
    message = ("comparing calls by their tokens (similarity_on='call', or a call whose code did not parse) "
               "needs a decode function")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        render(segments, PURIFIED)


# ----------------------------------------------------------------------------------------------
# Two shallow merges in a row: the merged turn carries a_0's reasoning, the last call, its tool


def search_chain() -> list:
    """Three `search` calls, each like the one before (ratio 11 / 12), the third succeeds; an answer."""
    return [
        prompt(0, (1,)),
        named(assistant(1, 0, 0, (10,), (11,), code='{"q": "1+1"}'), "search"),
        tool(2, 0, 0, (12,), ToolStatus.ERROR),
        named(assistant(3, 0, 1, (20,), (21, 22), code='{"q": "1+2"}'), "search"),
        tool(4, 0, 1, (23,), ToolStatus.ERROR),
        named(assistant(5, 0, 2, (30,), (31, 32), code='{"q": "1+3"}'), "search"),
        tool(6, 0, 2, (33,), ToolStatus.OK),
        assistant(7, 1, 0, (40, 41)),
    ]


def test_two_shallow_merges_keep_the_first_reasoning_and_the_last_call():
    rendered = render(search_chain(), PURIFIED)
    assert_rendered(rendered, ((1,), False), ((10, 31, 32), True), ((33,), False), ((40, 41), True))
    assert (rendered.stats.n_shallow, rendered.stats.n_deep, rendered.stats.tokens_removed) == (2, 0, 7)
    step, answer = explain(search_chain(), PURIFIED)
    assert step.outcome == Outcome.SHALLOW
    assert step.merges == (MergeDecision(1, pytest.approx(11 / 12), "shallow"),
                           MergeDecision(2, pytest.approx(11 / 12), "shallow"))
    # after the first merge the turn is seq 1 [0, 1) + seq 3 [1, 3); the second keeps seq 1 [0, 1) only
    assert step.kept == (KeptTokens(1, 0, 1), KeptTokens(5, 1, 3), KeptTokens(6, 0, 1))
    assert (step.removed_seqs, step.tokens_removed) == ((2, 3, 4), 7)  # 11 raw tokens, 4 kept
    assert answer.kept == (KeptTokens(7, 0, 2),)


def test_a_recovered_chains_negatives_are_each_failed_turn_as_it_stood_after_its_merge():
    # turns: a_0 = 10 | 11; after a_1: 10 | 21 22; the fix: 10 | 31 32, its call at row positions [2, 4)
    rendered = render(search_chain(), PURIFIED, negatives=True)
    assert rendered.negatives == (
        NegativeSample(seq=1, token_ids=(1, 10, 11), behavior_logprobs=(0.0, lp(10), lp(11)),
                       call_start=2, fix_start=2, fix_end=4),
        NegativeSample(seq=3, token_ids=(1, 10, 21, 22), behavior_logprobs=(0.0, lp(10), lp(21), lp(22)),
                       call_start=2, fix_start=2, fix_end=4),
    )


def test_a_chain_without_a_successful_call_gives_no_negatives():
    assert render(exhausted_chain(), PURIFIED, negatives=True).negatives == ()
    assert render(answered_chain(), PURIFIED, negatives=True).negatives == ()


# ----------------------------------------------------------------------------------------------
# The IS gate in a chain that is not recovered: raw from the rejected merge, the rest raw too


def test_a_rejected_merge_in_an_exhausted_chain_renders_it_raw_and_the_rest_raw():
    # step 0's shallow merge: R = (21,) after (1, 10); log IS = -1.0 - lp(21) = -0.979 < log 0.5.
    # The chain stays unrecovered, so step 1 is raw and its merge is never judged.
    oracle = TableOracle({(21,): -1.0})
    rendered = render(exhausted_chain(), gated(0.5), oracle=oracle)
    raw = render(exhausted_chain(), RAW)
    assert (rendered.token_ids, rendered.loss_mask, rendered.behavior_logprobs) == (
        raw.token_ids, raw.loss_mask, raw.behavior_logprobs)
    assert (rendered.stats.n_gated, rendered.stats.n_unrecovered, rendered.stats.n_shallow) == (1, 1, 0)
    assert not rendered.provisional and oracle.asked == [((1, 10), (21,))]
    first, second = explain(exhausted_chain(), gated(0.5), oracle=TableOracle({(21,): -1.0}))
    assert (first.outcome, second.outcome) == (Outcome.UNRECOVERED, Outcome.RAW)
    assert first.merges == (MergeDecision(1, pytest.approx(0.9), "shallow", pytest.approx(-1.0 + 0.021),
                                          rejected=True),)


def test_a_rejected_merge_before_an_answer_renders_the_chain_raw():
    # a_1 is unlike a_0 ("import numpy" vs "x=2; y=3": 2 * 2 / 20): deep, R = (20, 21) after (1,);
    # log IS = -1.0 + 0.041 = -0.959 < log 0.5.
    rendered = render(answered_chain(), gated(0.5), oracle=TableOracle({(20, 21): -1.0}))
    assert_rendered(rendered, ((1,), False), ((10, 11), True), ((12,), False), ((20, 21), True), ((22,), False),
                    ((30, 31), True))
    assert (rendered.stats.n_gated, rendered.stats.n_unrecovered, rendered.stats.n_deep) == (1, 1, 0)
    (step,) = explain(answered_chain(), gated(0.5), oracle=TableOracle({(20, 21): -1.0}))
    assert step.outcome == Outcome.ANSWERED and step.removed_seqs == ()
    assert step.merges == (MergeDecision(1, pytest.approx(0.2), "deep", pytest.approx(-0.959), rejected=True),)
    assert step.merges[0].log_is < math.log(0.5)


# ----------------------------------------------------------------------------------------------
# Malformed chains: each error names the rollout and the seq


@pytest.mark.parametrize(("segments", "message"), [
    ([prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,), code="x"), assistant(2, 0, 1, (20,), (21,), code="y")],
     "rollout r seq 2: attempt follows an attempt with no tool response"),
    ([prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,), code="x"), tool(2, 0, 0, (12,), ToolStatus.OK),
      assistant(3, 0, 1, (20,), (21,), code="y")],
     "rollout r seq 3: attempt follows a successful call at the same step"),
    ([prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,), code="x"), tool(2, 0, 0, (12,), ToolStatus.ERROR),
      tool(3, 0, 0, (13,), ToolStatus.ERROR)],
     "rollout r seq 3: tool segment without the call it answers"),
    ([prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,), code="x"), tool(2, 0, 0, (12,), ToolStatus.ERROR),
      assistant(3, 0, 2, (20,), (21,), code="y")],
     "rollout r seq 3: expected attempt 1, got 2"),
])
def test_a_malformed_chain_is_refused_naming_its_rollout_and_seq(segments, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        render(segments, PURIFIED)
