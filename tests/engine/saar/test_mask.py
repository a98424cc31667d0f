"""Edit mask on hand-built rollouts (docs/architecture.md §4): the raw tokens, and a loss mask that is
the raw one with 0 on every assistant token the replace rendering drops, except the tokens of an
attempt whose call succeeded.

Each expected mask is written out by hand from the chain's tokens (the builders and chains are
tests/factories.py's; behaviour log-probs are -id / 1000). For each case the test also checks the rule
against the two renderings themselves: the zeroed positions are the raw assistant tokens absent
from the replace row, less the successful attempt's.
"""

from __future__ import annotations

import pytest

from cleaner.engine.saar.walk import RAW, KeptTokens, RenderSettings, explain, render
from cleaner.records import SegmentKind, ToolStatus
from tests.factories import (
    DIFFERENT,
    SIMILAR,
    SUMS,
    TableOracle,
    answered_chain,
    exhausted_chain,
    lp,
    one_retry,
    three_attempts_chain,
    two_chains,
)

REPLACE = RenderSettings(purified=True, gamma=0.5)
MASK = RenderSettings(purified=True, gamma=0.5, edit="mask")


def masked_ids(segments, view=MASK, oracle=None) -> tuple[int, ...]:
    """The token ids a masked rendering leaves untrained although the raw one trains them."""
    rendered = render(segments, view, oracle=oracle)
    raw = render(segments, RAW)
    assert rendered.token_ids == raw.token_ids  # the raw sequence, token for token
    assert all(m <= r for m, r in zip(rendered.loss_mask, raw.loss_mask, strict=True))
    assert rendered.behavior_logprobs == pytest.approx(
        [lp(t) if m else 0.0 for t, m in zip(rendered.token_ids, rendered.loss_mask, strict=True)])
    return tuple(t for t, m, r in zip(raw.token_ids, rendered.loss_mask, raw.loss_mask, strict=True) if r and not m)


def dropped_less_success(segments, view=REPLACE, oracle=None) -> tuple[int, ...]:
    """The rule, read off the two renderings: raw assistant tokens the replace row does not contain
    (token ids are unique in these chains), less those of an attempt whose call succeeded."""
    replaced = set(render(segments, view, oracle=oracle).token_ids)
    ordered = sorted(segments, key=lambda s: s.seq)
    succeeded = {a.seq for a, t in zip(ordered, ordered[1:], strict=False)
                 if a.kind == SegmentKind.ASSISTANT and t.kind == SegmentKind.TOOL and t.tool_status == ToolStatus.OK}
    return tuple(t for s in ordered if s.kind == SegmentKind.ASSISTANT and s.seq not in succeeded
                 for t in s.token_ids if t not in replaced)


# ----------------------------------------------------------------------------------------------
# The cases of the acceptance list


def test_a_shallow_merge_masks_the_failed_call_and_keeps_the_fix_whole():
    # a_0 = 10 11 | 12 13 fails; a_1 = 20 | 21 22 succeeds. Replace: 10 11 21 22 (drops 12 13 and 20).
    segments = one_retry(SIMILAR)
    rendered = render(segments, MASK)
    assert rendered.loss_mask == (0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1)  # 1 2 10 11 12 13 14 20 21 22 23 30 31
    assert masked_ids(segments) == (12, 13) == dropped_less_success(segments)
    stats = rendered.stats
    assert (stats.n_shallow, stats.n_deep, stats.tokens_removed, stats.tokens_masked) == (1, 0, 0, 2)


def test_a_deep_merge_masks_the_failed_turn():
    segments = one_retry(DIFFERENT)
    assert render(segments, MASK).loss_mask == (0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1)
    assert masked_ids(segments) == (10, 11, 12, 13) == dropped_less_success(segments)
    assert render(segments, MASK).stats.n_deep == 1


def test_a_chain_of_several_failures():
    # a_0 = 10 | 11 fails; a_1 = 20 21 | 22 fails (deep: unlike a_0); a_2 = 30 | 31 32 succeeds
    # (shallow: like a_1). Replace: 20 21 31 32, so 10 11, 22 and 30 are dropped; 30 is the
    # successful attempt's reasoning and stays trained.
    segments = three_attempts_chain()
    assert render(segments, MASK).loss_mask == (0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0)
    assert masked_ids(segments) == (10, 11, 22) == dropped_less_success(segments)


def test_an_exhausted_chain_masks_what_its_merged_turn_drops_and_the_rest_nothing():
    # Step 0 exhausted: merged(a_0, a_1) = 10 | 21 (shallow) then the last error; step 1 renders
    # raw after it, so its failed call 30 31 stays trained. No attempt of step 0 succeeded.
    segments = exhausted_chain()
    assert render(segments, MASK).loss_mask == (0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0)
    assert masked_ids(segments) == (11, 20) == dropped_less_success(segments)
    assert render(segments, MASK).stats.n_unrecovered == 1


def test_a_retry_that_answers_masks_the_attempts_merged_before_it():
    # merged(a_0, a_1) is a_1 (deep), then t_1 and the answer: a_0 is dropped.
    segments = answered_chain()
    assert render(segments, MASK).loss_mask == (0, 0, 0, 0, 1, 1, 0, 1, 1)
    assert masked_ids(segments) == (10, 11) == dropped_less_success(segments)


def test_an_is_gated_chain_masks_nothing_and_a_kept_merge_masks_its_failed_turn():
    # tau 0.5 rejects step 0's merge (IS 0.384): replace renders it raw, so mask masks nothing
    # there; step 1's deep merge is kept (IS 1.023): its failed turn 30 31 32 is masked.
    gated_replace = RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=0.5)
    gated_mask = RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=0.5, edit="mask")
    segments = two_chains()
    rendered = render(segments, gated_mask, oracle=TableOracle(SUMS))
    assert rendered.loss_mask == (0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1)
    assert (rendered.stats.n_gated, rendered.stats.n_deep, rendered.stats.tokens_masked) == (1, 1, 3)
    assert masked_ids(segments, gated_mask, TableOracle(SUMS)) == (30, 31, 32) == dropped_less_success(
        segments, gated_replace, TableOracle(SUMS))
    everything_gated = RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=1e9, edit="mask")
    assert masked_ids(segments, everything_gated, TableOracle(SUMS)) == ()


def test_the_raw_view_and_a_view_that_is_not_purified_mask_nothing():
    segments = three_attempts_chain()
    assert render(segments, RenderSettings(purified=False, edit="mask")) == render(segments, RAW)


# ----------------------------------------------------------------------------------------------
# explain reports the masked ranges


def test_explain_keeps_every_raw_token_and_lists_the_masked_ranges():
    steps = explain(three_attempts_chain(), MASK)
    first, second = steps
    assert first.outcome == "mixed" and [m.kind for m in first.merges] == ["deep", "shallow"]
    assert first.masked == (KeptTokens(1, 0, 2), KeptTokens(3, 2, 3))  # a_0 whole, a_1's call
    assert first.removed_seqs == () and first.tokens_removed == 0
    assert first.kept == tuple(KeptTokens(seq, 0, n) for seq, n in ((1, 2), (2, 1), (3, 3), (4, 1), (5, 3), (6, 1)))
    assert second.masked == ()
    assert all(step.masked == () for step in explain(three_attempts_chain(), REPLACE))


def test_negative_samples_do_not_combine_with_mask():
    with pytest.raises(ValueError, match="mask"):
        render(one_retry(SIMILAR), MASK, negatives=True)
