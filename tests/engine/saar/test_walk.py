"""Renderer tests (docs/architecture.md §4): hand-written chains with exact tokens, then properties.

Token ids are tiny integers. Every assistant token's behaviour logprob is -id / 1000, so a logprob
that travels with the wrong token is caught.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cleaner.config import CollectConfig, Edit, IsMode, PurifyConfig, SaarRollback, SimilarityOn
from cleaner.engine.model.chat import format_call
from cleaner.engine.saar.gate import ScoreCache
from cleaner.engine.saar.walk import (
    RAW,
    KeptTokens,
    MergeDecision,
    RenderSettings,
    explain,
    render,
    render_settings,
    view_for,
)
from cleaner.records import Segment, SegmentKind, ToolStatus
from tests.factories import (
    DIFFERENT,
    SIMILAR,
    answered_chain,
    assistant,
    exhausted_chain,
    lp,
    one_retry,
    prompt,
    three_attempts_chain,
    tool,
    two_chains,
)
from tests.helpers import assert_rendered

PURIFIED = RenderSettings(purified=True, gamma=0.5, similarity_on="code")



def test_raw_is_concatenation_in_seq_order():
    segments = one_retry(SIMILAR)
    rendered = render(list(reversed(segments)), RAW)
    assert_rendered(rendered, ((1, 2), False), ((10, 11, 12, 13), True), ((14,), False),
          ((20, 21, 22), True), ((23,), False), ((30, 31), True))
    assert rendered.prompt_len == 2
    assert rendered.stats.tokens_removed == 0


def test_shallow_merge_keeps_reasoning_and_takes_new_call():
    rendered = render(one_retry(SIMILAR), PURIFIED)
    assert_rendered(rendered, ((1, 2), False), ((10, 11, 21, 22), True), ((23,), False), ((30, 31), True))
    assert (rendered.stats.n_shallow, rendered.stats.n_deep, rendered.stats.n_unrecovered) == (1, 0, 0)
    assert rendered.stats.tokens_removed == 13 - 9


def test_deep_merge_replaces_whole_turn():
    rendered = render(one_retry(DIFFERENT), PURIFIED)
    assert_rendered(rendered, ((1, 2), False), ((20, 21, 22), True), ((23,), False), ((30, 31), True))
    assert (rendered.stats.n_shallow, rendered.stats.n_deep) == (0, 1)
    assert rendered.stats.tokens_removed == 13 - 8


def test_three_attempts_deep_then_shallow():
    segments = three_attempts_chain()
    rendered = render(segments, PURIFIED)
    assert_rendered(rendered, ((1,), False), ((20, 21, 31, 32), True), ((33,), False),
          ((40, 41), True), ((42,), False))
    assert (rendered.stats.n_shallow, rendered.stats.n_deep, rendered.stats.n_unrecovered) == (1, 1, 0)


def test_exhausted_chain_renders_rest_raw():
    segments = exhausted_chain()
    rendered = render(segments, PURIFIED)
    assert_rendered(rendered, ((1,), False), ((10, 21), True), ((22,), False),
          ((30, 31), True), ((32,), False), ((40, 41), True), ((42,), False))
    assert (rendered.stats.n_shallow, rendered.stats.n_unrecovered) == (1, 1)
    # In progress (the retry not generated yet) renders the same tokens as exhausted.
    partial = render(segments[:5], PURIFIED)
    assert rendered.token_ids[: len(partial.token_ids)] == partial.token_ids
    assert len(partial.token_ids) == 4


def test_retry_that_answers_keeps_last_error_then_rest_raw():
    segments = answered_chain()
    rendered = render(segments, PURIFIED)
    assert_rendered(rendered, ((1,), False), ((20, 21), True), ((22,), False), ((30, 31), True))
    assert (rendered.stats.n_deep, rendered.stats.n_unrecovered, rendered.stats.tokens_removed) == (1, 1, 3)


# ----------------------------------------------------------------------------------------------
# similarity_on: code vs call on the example of docs/architecture.md §10


def text_assistant(seq, attempt, reasoning: str, code: str | None, call_code: str) -> Segment:
    text = reasoning + format_call(call_code)
    ids = tuple(ord(c) for c in text)
    return Segment("r", 0, seq, SegmentKind.ASSISTANT, 0, attempt, ids, tuple(lp(i) for i in ids), text,
                   call_start=len(reasoning), tool_code=code)


def decode(token_ids) -> str:
    return "".join(chr(i) for i in token_ids)


def measured_chain(first_code: str | None) -> list[Segment]:
    numpy_code, plain_code = "import numpy; print(numpy.add(2,2))", "x=2; print(x+x)"
    return [
        prompt(0, (1,)),
        text_assistant(1, 0, "Add. ", first_code, numpy_code),
        tool(2, 0, 0, (2,), ToolStatus.ERROR),
        text_assistant(3, 1, "Again. ", plain_code, plain_code),
        tool(4, 0, 1, (3,), ToolStatus.OK),
    ]


def test_code_similarity_is_deep_where_call_similarity_is_shallow():
    segments = measured_chain("import numpy; print(numpy.add(2,2))")
    by_code = render(segments, RenderSettings(True, gamma=0.5, similarity_on="code"), decode)
    by_call = render(segments, RenderSettings(True, gamma=0.5, similarity_on="call"), decode)
    assert (by_code.stats.n_deep, by_call.stats.n_shallow) == (1, 1)
    assert decode(by_code.token_ids[1:-1]) == "Again. " + format_call("x=2; print(x+x)")
    assert decode(by_call.token_ids[1:-1]) == "Add. " + format_call("x=2; print(x+x)")


def test_code_falls_back_to_call_when_code_is_missing():
    rendered = render(measured_chain(None), RenderSettings(True, gamma=0.5, similarity_on="code"), decode)
    assert rendered.stats.n_shallow == 1


def test_call_similarity_without_decode_is_a_clear_error():
    with pytest.raises(ValueError, match="decode"):
        render(measured_chain(None), RenderSettings(True, gamma=0.5, similarity_on="call"))
    with pytest.raises(ValueError, match="decode"):
        render(measured_chain(None), RenderSettings(True, gamma=0.5, similarity_on="code"))  # fallback needs decode too


def test_malformed_chain_is_rejected():
    segments = one_retry(SIMILAR)
    segments[3] = assistant(3, 0, 2, (20,), (21, 22), code="x")  # attempt 2 right after attempt 0
    with pytest.raises(ValueError, match="expected attempt 1"):
        render(segments, PURIFIED)


def test_view_for_follows_the_draw():
    assert view_for(0.3, True, SaarRollback(gamma=0.7, rollback_prob=0.5, similarity_on="call")) == \
        RenderSettings(True, gamma=0.7, similarity_on="call")
    assert view_for(0.5, True, SaarRollback(gamma=0.7, rollback_prob=0.5, similarity_on="call")) == RAW
    assert view_for(0.0, False, SaarRollback(gamma=0.7, rollback_prob=1.0, similarity_on="code")) == RAW


def test_a_view_holds_how_a_config_renders_and_not_whether_it_purifies():
    """A purify config's view is its merge, gate and edit; p and purify_when only decide whether a
    rollout is purified, so configs that differ in them share their renderings (purify's cache key)."""
    gated = PurifyConfig(gamma=0.7, similarity_on="call", rollback_is_threshold=0.5, rollback_is_mode="mean",
                         edit="mask")
    expected = RenderSettings(True, gamma=0.7, similarity_on="call", rollback_is_threshold=0.5,
                              rollback_is_mode="mean", edit="mask")
    assert view_for(0.1, True, gated) == render_settings(gated) == expected
    assert render_settings(PurifyConfig(rollback_prob=0.3, purify_when="positive")) == render_settings(PurifyConfig())
    collected = CollectConfig(gamma=0.7, similarity_on="call", rollback_is_threshold=0.5, rollback_is_mode="mean")
    assert view_for(0.1, True, collected) == dataclasses.replace(expected, edit="replace")  # collect has no edit


# ----------------------------------------------------------------------------------------------
# Properties over generated attempt chains


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]
    chains: tuple[tuple[Segment, ...], ...]  # the non-prompt segments of each step
    outcomes: tuple[str, ...]  # per chain: clean | recovered | unrecovered
    merges: tuple[int, ...]  # per chain: merges SAAR performs on it


@st.composite
def plans(draw) -> Plan:
    """A prompt, then steps of attempts; token ids are seq * 100 + k, so each token names its segment."""
    segments: list[Segment] = []

    def add(kind, step, attempt, n_reasoning, n_call=0, code=None, status=None) -> Segment:
        seq = len(segments)
        ids = tuple(seq * 100 + k for k in range(n_reasoning + n_call))
        lps = tuple(lp(i) for i in ids) if kind == SegmentKind.ASSISTANT else None
        segment = Segment("r", 0, seq, kind, step, attempt, ids, lps, "",
                          call_start=n_reasoning if n_call else None, tool_code=code,
                          tool_status=status)
        segments.append(segment)
        return segment

    add(SegmentKind.PROMPT, None, None, draw(st.integers(1, 3)))
    chains, outcomes, merges = [], [], []
    for step in range(draw(st.integers(1, 4))):
        first = len(segments)
        statuses = draw(st.lists(st.sampled_from([ToolStatus.OK, ToolStatus.ERROR]), min_size=1, max_size=4))
        n_attempts = statuses.index(ToolStatus.OK) + 1 if ToolStatus.OK in statuses else len(statuses)
        for attempt in range(n_attempts):
            code = draw(st.text("ab()+1", max_size=6))
            add(SegmentKind.ASSISTANT, step, attempt, draw(st.integers(0, 2)), draw(st.integers(1, 2)), code)
            add(SegmentKind.TOOL, step, attempt, draw(st.integers(1, 2)), status=statuses[attempt])
        answered = ToolStatus.OK not in statuses and draw(st.booleans())
        if answered:  # a retry that answers instead of calling
            add(SegmentKind.ASSISTANT, step, n_attempts, draw(st.integers(1, 2)))
        chains.append(tuple(segments[first:]))
        if ToolStatus.OK in statuses:
            outcomes.append("clean" if n_attempts == 1 else "recovered")
            merges.append(n_attempts - 1)
        else:
            outcomes.append("unrecovered")
            merges.append(n_attempts - 1)
    if draw(st.booleans()):
        add(SegmentKind.ASSISTANT, len(chains), 0, draw(st.integers(1, 2)))  # final answer
        chains.append(tuple(segments[-1:]))
        outcomes.append("clean")
        merges.append(0)
    return Plan(tuple(segments), tuple(chains), tuple(outcomes), tuple(merges))


def raw_ids(segments) -> tuple[int, ...]:
    return tuple(i for segment in segments for i in segment.token_ids)


def processed(plan: Plan) -> list[int]:
    """Indices of the chains SAAR touches: up to and including the first unrecovered one."""
    indices = []
    for index, outcome in enumerate(plan.outcomes):
        indices.append(index)
        if outcome == "unrecovered":
            break
    return indices


@settings(max_examples=150, deadline=None)
@given(plans(), st.floats(0, 1.2))
def test_mask_and_logprobs_align_with_tokens(plan, gamma):
    by_seq = {segment.seq: segment for segment in plan.segments}
    for view in (RAW, RenderSettings(True, gamma=gamma, similarity_on="code")):
        rendered = render(plan.segments, view)
        assert len(rendered.token_ids) == len(rendered.loss_mask) == len(rendered.behavior_logprobs)
        for token, mask, logprob in zip(rendered.token_ids, rendered.loss_mask,
                                        rendered.behavior_logprobs, strict=True):
            origin = by_seq[token // 100]
            assert mask == int(origin.kind == SegmentKind.ASSISTANT)
            assert logprob == (lp(token) if mask else 0.0)
        assert rendered.prompt_len == len(plan.segments[0].token_ids)
        assert rendered.stats.tokens_removed == len(raw_ids(plan.segments)) - len(rendered.token_ids)


@settings(max_examples=100, deadline=None)
@given(plans(), st.floats(0, 0.999), st.floats(0, 1.5))
def test_rollback_prob_zero_is_exactly_raw(plan, draw, gamma):
    view = view_for(draw, True, SaarRollback(gamma=gamma, rollback_prob=0.0))
    assert view == RAW
    rendered = render(plan.segments, view)
    assert rendered.token_ids == raw_ids(plan.segments)
    assert rendered.stats == render(plan.segments, RAW).stats


@settings(max_examples=60, deadline=None)
@given(plans(), st.floats(0, 1.2), st.sampled_from(["code", "call"]))
def test_rollout_without_a_failed_call_renders_raw_under_every_view(plan, gamma, similarity_on):
    # purify renders such a rollout once for every config of an ablation grid, relying on this
    assume(not any(segment.kind == SegmentKind.TOOL and segment.failed for segment in plan.segments))
    assert render(plan.segments, RenderSettings(True, gamma=gamma, similarity_on=similarity_on), decode=str) == render(plan.segments, RAW)


@settings(max_examples=150, deadline=None)
@given(plans())
def test_gamma_zero_is_all_shallow_and_gamma_above_one_all_deep(plan):
    expected_merges = sum(plan.merges[index] for index in processed(plan))
    shallow = render(plan.segments, RenderSettings(True, gamma=0.0, similarity_on="code")).stats
    deep = render(plan.segments, RenderSettings(True, gamma=1.01, similarity_on="code")).stats
    assert (shallow.n_shallow, shallow.n_deep) == (expected_merges, 0)
    assert (deep.n_shallow, deep.n_deep) == (0, expected_merges)
    assert shallow.n_unrecovered == deep.n_unrecovered == ("unrecovered" in plan.outcomes)


@settings(max_examples=150, deadline=None)
@given(plans(), st.floats(0, 1.2))
def test_recovered_chain_leaves_no_failed_call_or_error(plan, gamma):
    rendered = set(render(plan.segments, RenderSettings(True, gamma=gamma, similarity_on="code")).token_ids)
    for index in processed(plan):
        if plan.outcomes[index] != "recovered":
            continue
        chain = plan.chains[index]
        for position, segment in enumerate(chain):
            if segment.kind == SegmentKind.TOOL and segment.failed:
                call = chain[position - 1]
                assert not rendered & set(segment.token_ids)
                assert not rendered & set(call.token_ids[call.call_start:])


@settings(max_examples=150, deadline=None)
@given(plans(), st.floats(0, 1.2))
def test_unrecovered_chain_renders_rest_raw(plan, gamma):
    if "unrecovered" not in plan.outcomes:
        return
    chain = plan.chains[plan.outcomes.index("unrecovered")]
    rendered = render(plan.segments, RenderSettings(True, gamma=gamma, similarity_on="code"))
    last_tool = [segment for segment in chain if segment.kind == SegmentKind.TOOL][-1]
    rest = [segment for segment in plan.segments if segment.seq > last_tool.seq]
    tail = raw_ids([last_tool, *rest])
    assert rendered.token_ids[-len(tail):] == tail
    # Cut right after the last failed call (a retry not generated yet): a prefix of the full render.
    partial = render([s for s in plan.segments if s.seq <= last_tool.seq], RenderSettings(True, gamma=gamma, similarity_on="code"))
    assert rendered.token_ids[: len(partial.token_ids)] == partial.token_ids


# ----------------------------------------------------------------------------------------------
# explain: the renderer's own decisions, step by step


def kept(*ranges: tuple[int, int, int]) -> tuple[KeptTokens, ...]:
    return tuple(KeptTokens(*r) for r in ranges)


def test_explain_shallow_keeps_first_reasoning_and_second_call():
    steps = explain(one_retry(SIMILAR), PURIFIED)
    assert [s.outcome for s in steps] == ["shallow", "clean"]
    first, answer = steps
    assert (first.step, first.seqs, first.attempts) == (0, (1, 2, 3, 4), 2)
    assert first.merges == (MergeDecision(1, pytest.approx(0.9), "shallow"),)
    assert first.kept == kept((1, 0, 2), (3, 1, 3), (4, 0, 1))  # reasoning of a_0, call of a_1, t_1
    assert (first.removed_seqs, first.tokens_removed) == ((2,), 4)
    assert (answer.step, answer.kept, answer.removed_seqs, answer.merges) == (1, kept((5, 0, 2)), (), ())


def test_explain_deep_drops_the_failed_attempt_and_its_error():
    first = explain(one_retry(DIFFERENT), PURIFIED)[0]
    assert first.outcome == "deep"
    assert first.merges == (MergeDecision(1, pytest.approx(0.2), "deep"),)  # "import numpy" vs "x=2; y=3"
    assert first.kept == kept((3, 0, 3), (4, 0, 1))
    assert (first.removed_seqs, first.tokens_removed) == ((1, 2), 5)


def test_explain_three_attempts_is_mixed():
    (step,) = explain(three_attempts_chain()[:7], PURIFIED)  # step 0 only
    assert step.outcome == "mixed" and step.attempts == 3
    assert [(m.attempt, m.kind) for m in step.merges] == [(1, "deep"), (2, "shallow")]
    # difflib is order-sensitive: ("import numpy", "print(1+1)") matches 2 chars, 2 * 2 / 22 = 2 / 11
    assert [m.similarity for m in step.merges] == [pytest.approx(2 / 11), pytest.approx(0.9)]
    assert step.kept == kept((3, 0, 2), (5, 1, 3), (6, 0, 1))
    assert step.removed_seqs == (1, 2, 4)


def test_explain_unrecovered_then_raw():
    first, second = explain(exhausted_chain(), PURIFIED)
    assert (first.outcome, first.kept, first.removed_seqs) == ("unrecovered", kept((1, 0, 1), (3, 1, 2), (4, 0, 1)), (2,))
    assert [m.kind for m in first.merges] == ["shallow"]
    assert (second.outcome, second.merges, second.removed_seqs, second.tokens_removed) == ("raw", (), (), 0)
    assert second.kept == kept((5, 0, 2), (6, 0, 1), (7, 0, 2), (8, 0, 1))


def test_explain_answered_keeps_last_error():
    (step,) = explain(answered_chain(), PURIFIED)
    assert (step.outcome, step.attempts, step.tokens_removed) == ("answered", 3, 3)
    assert step.merges == (MergeDecision(1, pytest.approx(0.2), "deep"),)
    assert step.kept == kept((3, 0, 2), (4, 0, 1), (5, 0, 2))
    assert step.removed_seqs == (1, 2)


def test_explain_raw_view_removes_nothing():
    steps = explain(one_retry(SIMILAR), RAW)
    assert [s.outcome for s in steps] == ["raw", "raw"]
    assert all(s.removed_seqs == () and s.tokens_removed == 0 and s.merges == () for s in steps)


@settings(max_examples=150, deadline=None)
@given(plans(), st.floats(0, 1.2))
def test_explain_agrees_with_render(plan, gamma):
    view = RenderSettings(True, gamma=gamma, similarity_on="code")
    rendered = render(plan.segments, view)
    steps = explain(plan.segments, view)
    by_seq = {segment.seq: segment for segment in plan.segments}
    ids = raw_ids(s for s in plan.segments if s.kind == SegmentKind.PROMPT)
    ids += tuple(i for s in steps for k in s.kept for i in by_seq[k.seq].token_ids[k.start:k.end])
    assert ids == rendered.token_ids  # the kept ranges ARE the rendering
    assert sum(s.tokens_removed for s in steps) == rendered.stats.tokens_removed
    merges = [m.kind for s in steps for m in s.merges]
    assert (merges.count("shallow"), merges.count("deep")) == (rendered.stats.n_shallow, rendered.stats.n_deep)
    assert sum(s.outcome in ("unrecovered", "answered") for s in steps) == rendered.stats.n_unrecovered
    assert all((m.kind == "shallow") == (m.similarity >= gamma) for s in steps for m in s.merges)


# ----------------------------------------------------------------------------------------------
# The saar batch's survivors (docs/mutants.md): settings, errors, edit mask's row and ranges, negatives


def test_settings_hold_their_enums_and_name_the_field_they_refuse():
    view = RenderSettings(True, gamma=0.5, similarity_on="call", rollback_is_threshold=0.8,
                          rollback_is_mode="mean", edit="mask")
    assert (view.similarity_on, view.rollback_is_mode, view.edit) == ("call", "mean", "mask")
    assert (type(view.similarity_on), type(view.rollback_is_mode), type(view.edit)) == (SimilarityOn, IsMode, Edit)
    for field, value, choices in (("similarity_on", "diff", "['code', 'call']"), ("rollback_is_mode", "max", "['sum', 'mean']"),
                                  ("edit", "drop", "['replace', 'mask']")):
        with pytest.raises(ValueError) as refused:
            RenderSettings(True, **{field: value})
        assert str(refused.value) == f"{field} must be one of {choices}, got '{value}'"
    with pytest.raises(ValueError) as refused:
        RenderSettings(True, gamma=-0.25)
    assert str(refused.value) == "gamma must be >= 0, got -0.25"
    with pytest.raises(ValueError) as refused:
        RenderSettings(True, rollback_is_threshold=-0.5)
    assert str(refused.value) == "rollback_is_threshold must be >= 0, got -0.5"


def test_view_for_passes_the_gate_and_the_edit_on():
    view = view_for(0.3, True, PurifyConfig(gamma=0.7, rollback_prob=0.5, similarity_on="call", rollback_is_threshold=0.8,
                                          rollback_is_mode="mean", edit="mask"))
    assert (view.purified, view.gamma, view.similarity_on) == (True, 0.7, "call")
    assert (view.rollback_is_threshold, view.rollback_is_mode, view.edit) == (0.8, "mean", "mask")


def test_negatives_under_edit_mask_are_refused_in_full():
    with pytest.raises(ValueError) as refused:
        render(one_retry(SIMILAR), RenderSettings(True, gamma=0.5, edit="mask"), negatives=True)
    assert str(refused.value) == ("negative samples pair a failed call with a fix spliced into a purified row; "
                                  "edit 'mask' builds none")


def test_an_edit_mask_row_keeps_its_prompt_length_and_provisional_flag_and_has_no_negatives():
    masked = render(exhausted_chain(), RenderSettings(True, gamma=0.5, edit="mask"))
    assert (masked.prompt_len, masked.negatives) == (1, ()) and masked.provisional is False
    # IS-gated with an oracle that knows nothing yet: both merges of two_chains kept for now
    pending = render(two_chains(), RenderSettings(True, gamma=0.5, rollback_is_threshold=0.5, edit="mask"), oracle=ScoreCache())
    assert (pending.prompt_len, pending.negatives, pending.provisional) == (2, (), True)
    assert pending.token_ids == render(two_chains(), RAW).token_ids


def test_explain_lists_a_masked_range_before_a_kept_call_and_none_for_a_whole_attempt():
    # Step 0 exhausted: merged(a_0, a_1) = 10 | 21 (shallow): a_0's call [1, 2) and a_1's reasoning
    # [0, 1) masked, neither attempt succeeded. Step 1 raw: its failed a_0 (seq 5) kept whole, no range.
    first, second = explain(exhausted_chain(), RenderSettings(True, gamma=0.5, edit="mask"))
    assert first.masked == kept((1, 1, 2), (3, 0, 1))
    assert second.masked == ()


def test_explain_by_call_similarity_decodes_the_calls():
    # by call, "Add. " + call(numpy) and "Again. " + call(plain) are alike: shallow, a_0's reasoning kept
    (step,) = explain(measured_chain("import numpy; print(numpy.add(2,2))"), RenderSettings(True, gamma=0.5, similarity_on="call"),
                      decode)
    retry = len("Again. " + format_call("x=2; print(x+x)"))
    assert (step.outcome, [m.kind for m in step.merges]) == ("shallow", ["shallow"])
    assert step.kept == kept((1, 0, len("Add. ")), (3, len("Again. "), retry), (4, 0, 1))


def test_negative_samples_are_each_failed_turn_after_the_rendered_context_with_the_fix_located():
    # two_chains: step 0's a_0 = 10 11 | 12 13 (shallow fix 10 11 | 21 22 at [4, 6) of the row
    # 1 2 10 11 21 22 23 40 41 42 43 50 51); step 1's a_0 = 30 | 31 32 after the 7 tokens rendered
    # before it (deep fix 40 41 | 42 at [9, 10)).
    rendered = render(two_chains(), PURIFIED, negatives=True)
    assert rendered.token_ids == (1, 2, 10, 11, 21, 22, 23, 40, 41, 42, 43, 50, 51)
    first, second = rendered.negatives
    assert (first.seq, first.token_ids, first.call_start, first.fix_start, first.fix_end) == (
        1, (1, 2, 10, 11, 12, 13), 4, 4, 6)
    assert first.behavior_logprobs == pytest.approx((0.0, 0.0, lp(10), lp(11), lp(12), lp(13)))
    assert (second.seq, second.token_ids, second.call_start, second.fix_start, second.fix_end) == (
        5, (1, 2, 10, 11, 21, 22, 23, 30, 31, 32), 8, 9, 10)
    assert second.behavior_logprobs == pytest.approx((0.0,) * 7 + (lp(30), lp(31), lp(32)))
    # three attempts: a_0 (10 | 11) and the deep turn a_1 (20 21 | 22) each after the prompt; the
    # fix 20 21 | 31 32 is at [3, 5); the clean step 1 has none
    negatives = render(three_attempts_chain(), PURIFIED, negatives=True).negatives
    assert [(n.seq, n.token_ids, n.call_start, n.fix_start, n.fix_end) for n in negatives] == [
        (1, (1, 10, 11), 2, 3, 5), (3, (1, 20, 21, 22), 3, 3, 5)]
    assert render(two_chains(), PURIFIED).negatives == ()
    assert render(exhausted_chain(), PURIFIED, negatives=True).negatives == ()  # no chain recovered by a merge


def test_a_failed_attempt_without_a_located_call_gives_no_negative_and_the_next_still_does():
    # a_0 = 10 11 has no call_start (its call was not located) yet its tool answered with an error;
    # a_1 = 20 | 21 (deep: a_0 has no call to compare) fails; a_2 = 30 | 31, like a_1, succeeds:
    # the row is 1, 20 | 31, 32, the fix at [2, 3); only a_1 is a negative sample
    segments = [prompt(0, (1,)), assistant(1, 0, 0, (10, 11)), tool(2, 0, 0, (12,), ToolStatus.ERROR),
                assistant(3, 0, 1, (20,), (21,), code="print(1+1)"), tool(4, 0, 1, (22,), ToolStatus.ERROR),
                assistant(5, 0, 2, (30,), (31,), code="print(1+2)"), tool(6, 0, 2, (32,))]
    rendered = render(segments, PURIFIED, negatives=True)
    assert rendered.token_ids == (1, 20, 31, 32)
    (negative,) = rendered.negatives
    assert (negative.seq, negative.token_ids, negative.call_start, negative.fix_start, negative.fix_end) == (
        3, (1, 20, 21), 2, 2, 3)
    assert negative.behavior_logprobs == pytest.approx((0.0, lp(20), lp(21)))


def test_bad_input_is_refused_in_full():
    other = dataclasses.replace(one_retry(SIMILAR)[1], rollout_id="q")
    refusals = [
        ([], RAW, "render needs at least one segment"),
        ([*one_retry(SIMILAR), other], RAW, "render takes the segments of one rollout; got several rollout_ids"),
        ([assistant(0, 0, 0, (10,)), prompt(1, (1,))], RAW, "rollout r: prompt segments must come first"),
        (measured_chain(None), RenderSettings(True, gamma=0.5, similarity_on="call"),
         "similarity_on='call' needs a decode function (token ids -> text)"),
        (two_chains(), RenderSettings(True, gamma=0.5, rollback_is_threshold=0.5),
         "an IS-gated view (rollback_is_threshold > 0) needs an oracle of old-policy log-probs"),
    ]
    for segments, view, message in refusals:
        with pytest.raises(ValueError) as refused:
            render(segments, view)
        assert str(refused.value) == message
