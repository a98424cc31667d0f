"""The IS gate on hand-built chains (docs/architecture.md §4, saar/merge.py), then against a real forward.

Behaviour log-probs are -id / 1000 (tests/factories.py's chains). The oracle of old-policy log-probs
is a table keyed by the merge's tokens R, and records every context it was asked about, so each
decision can be computed by hand: log IS = oracle(R) - sum(-id / 1000 for id in R).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from cleaner.engine.saar.gate import Gate, ScoreCache
from cleaner.engine.saar.walk import RAW, Outcome, RenderSettings, explain, render
from tests.factories import SUMS, TableOracle, lp, two_chains
from tests.helpers import assert_rendered

LOG_IS_0 = -1.0 - (lp(21) + lp(22))  # -0.957: IS 0.384
LOG_IS_1 = -0.1 - (lp(40) + lp(41) + lp(42))  # +0.023: IS 1.023
PURIFIED = RenderSettings(purified=True, gamma=0.5)


def gated(tau: float) -> RenderSettings:
    return RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=tau)


def test_tau_zero_renders_exactly_the_purified_view():
    plain = render(two_chains(), PURIFIED)
    gate_off = render(two_chains(), gated(0.0), oracle=TableOracle({}))
    assert gate_off == plain
    assert_rendered(plain, ((1, 2), False), ((10, 11, 21, 22), True), ((23,), False), ((40, 41, 42), True),
          ((43,), False), ((50, 51), True))


def test_a_tau_above_every_is_renders_exactly_the_raw_view():
    rendered = render(two_chains(), gated(1e9), oracle=TableOracle(SUMS))
    raw = render(two_chains(), RAW)
    assert (rendered.token_ids, rendered.loss_mask, rendered.behavior_logprobs) == (
        raw.token_ids, raw.loss_mask, raw.behavior_logprobs)
    assert (rendered.stats.n_gated, rendered.stats.n_shallow, rendered.stats.n_deep) == (2, 0, 0)
    assert rendered.stats.tokens_removed == 0


def test_a_middle_tau_keeps_the_first_chain_raw_and_purifies_the_next():
    oracle = TableOracle(SUMS)
    rendered = render(two_chains(), gated(0.5), oracle=oracle)  # IS 0.384 < 0.5 <= 1.023
    assert_rendered(rendered, ((1, 2), False), ((10, 11, 12, 13), True), ((14,), False), ((20, 21, 22), True),
          ((23,), False), ((40, 41, 42), True), ((43,), False), ((50, 51), True))
    assert (rendered.stats.n_gated, rendered.stats.n_shallow, rendered.stats.n_deep) == (1, 0, 1)
    # The contexts: the shallow merge after the prompt and a_0's reasoning; the deep one after
    # everything rendered before its chain, which is chain 0 raw.
    assert oracle.asked == [((1, 2, 10, 11), (21, 22)),
                            ((1, 2, 10, 11, 12, 13, 14, 20, 21, 22, 23), (40, 41, 42))]
    steps = explain(two_chains(), gated(0.5), oracle=TableOracle(SUMS))
    assert [step.outcome for step in steps] == [Outcome.GATED, Outcome.DEEP, Outcome.CLEAN]
    (first,), (second,) = steps[0].merges, steps[1].merges
    assert (first.rejected, second.rejected) == (True, False)
    assert first.log_is == pytest.approx(LOG_IS_0) and second.log_is == pytest.approx(LOG_IS_1)


def test_the_second_merge_is_judged_under_the_purified_first_chain():
    oracle = TableOracle({(21, 22): 0.0, (40, 41, 42): -0.1})  # both kept
    render(two_chains(), gated(0.5), oracle=oracle)
    assert oracle.asked[1] == ((1, 2, 10, 11, 21, 22, 23), (40, 41, 42))


def test_an_unknown_is_keeps_the_merge_for_now_and_marks_the_rendering_provisional():
    cache = ScoreCache()
    rendered = render(two_chains(), gated(0.5), oracle=cache)
    assert rendered.provisional and rendered.token_ids == render(two_chains(), PURIFIED).token_ids
    assert list(cache.pending) == [((1, 2, 10, 11, 21, 22), 4), ((1, 2, 10, 11, 21, 22, 23, 40, 41, 42), 7)]

    def score(sequences, starts):  # -1.0 for R of the shallow merge, -0.05 per token otherwise
        return [[-0.5] * 2 if s[st:] == (21, 22) else [-0.05] * (len(s) - st)
                for s, st in zip(sequences, starts, strict=True)]

    rounds = 0
    while rendered.provisional:  # the first merge is rejected, so the second has a new context
        cache.fill(score)
        rendered, rounds = render(two_chains(), gated(0.5), oracle=cache), rounds + 1
    assert rounds == 2 and rendered.stats.n_gated == 1  # the first merge: IS 0.384 < 0.5
    assert rendered.token_ids[:11] == (1, 2, 10, 11, 12, 13, 14, 20, 21, 22, 23)


def test_the_is_of_a_merge_equals_a_naive_forward_minus_the_behaviour_logprobs():
    from cleaner.engine.model.trie_scorer import PrefixTrieScorer
    from tests.helpers import tiny_qwen3

    model = tiny_qwen3(seed=3).eval()
    segments = two_chains()
    cache = ScoreCache()
    view = gated(0.5)
    while render(segments, view, oracle=cache).provisional:
        cache.fill(PrefixTrieScorer(model).score_rows)
    steps = explain(segments, view, oracle=cache)

    def naive(context, tokens):
        ids = torch.tensor([context + tokens])
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits[0].log_softmax(-1)  # (T, V)
        return sum(logprobs[len(context) + k - 1, token].item() for k, token in enumerate(tokens))

    first = steps[0].merges[0]
    expected_0 = naive((1, 2, 10, 11), (21, 22)) - (lp(21) + lp(22))
    assert first.log_is == pytest.approx(expected_0, abs=1e-4)
    chain_0 = (1, 2, 10, 11, 12, 13, 14, 20, 21, 22, 23) if first.rejected else (1, 2, 10, 11, 21, 22, 23)
    expected_1 = naive(chain_0, (40, 41, 42)) - (lp(40) + lp(41) + lp(42))
    assert steps[1].merges[0].log_is == pytest.approx(expected_1, abs=1e-4)
    assert first.rejected == (expected_0 < math.log(0.5))


def test_the_per_token_mode_divides_the_log_is_by_the_tokens_of_r():
    view = RenderSettings(purified=True, gamma=0.5, rollback_is_threshold=0.5, rollback_is_mode="mean")
    steps = explain(two_chains(), view, oracle=TableOracle(SUMS))
    assert steps[0].merges[0].log_is == pytest.approx(LOG_IS_0 / 2)  # IS 0.62 >= 0.5: kept
    assert steps[1].merges[0].log_is == pytest.approx(LOG_IS_1 / 3)
    assert render(two_chains(), view, oracle=TableOracle(SUMS)).token_ids == render(two_chains(), PURIFIED).token_ids


# ----------------------------------------------------------------------------------------------
# The saar batch's survivors (docs/mutants.md): the gate's edges and the cache's bookkeeping


def test_a_one_token_r_is_its_own_per_token_mean_and_an_is_exactly_at_tau_is_kept():
    gate = Gate(0.5, TableOracle({(21,): -0.5}), per_token=True)
    assert gate.log_is((1, 2), (21,), [lp(21)]) == pytest.approx(-0.5 + 0.021)  # / 1 token
    assert (gate.rejects(math.log(0.5)), gate.rejects(math.nextafter(math.log(0.5), -1.0))) == (False, True)
    assert gate.rejects(None) is False and gate.provisional is False


def test_filling_the_cache_empties_what_is_pending_and_a_bad_scorer_is_refused_in_full():
    cache = ScoreCache()
    assert cache.get((1, 2, 3), 1) is None and list(cache.pending) == [((1, 2, 3), 1)]
    assert cache.fill(lambda sequences, starts: [[-0.25, -0.5]]) == 1
    assert (cache.scores, cache.pending) == ({((1, 2, 3), 1): (-0.25, -0.5)}, {})
    assert cache.logprob_sum((1,), (2, 3)) == -0.75 and cache.fill(lambda sequences, starts: []) == 0
    cache.get((4, 5, 6), 1)
    with pytest.raises(ValueError) as refused:
        cache.fill(lambda sequences, starts: [])
    assert str(refused.value) == "scorer returned 0 results for 1 sequences"
    with pytest.raises(ValueError) as refused:
        cache.fill(lambda sequences, starts: [[-0.25]])
    assert str(refused.value) == "scorer returned 1 logprobs for 2 tokens after position 1"
    assert list(cache.pending) == [((4, 5, 6), 1)]  # still wanted


def test_the_async_fill_scores_every_pending_request_in_one_awaited_call():
    cache = ScoreCache()
    cache.get((1, 2, 3), 1)
    cache.get((1, 2, 3, 4), 3)
    calls = []

    async def score(sequences, starts):
        calls.append((list(sequences), list(starts)))
        return [[-0.25, -0.5], [-1.0]]

    assert asyncio.run(cache.fill_async(score)) == 2
    assert calls == [([(1, 2, 3), (1, 2, 3, 4)], [1, 3])]
    assert cache.scores == {((1, 2, 3), 1): (-0.25, -0.5), ((1, 2, 3, 4), 3): (-1.0,)} and cache.pending == {}
    assert asyncio.run(cache.fill_async(score)) == 0 and len(calls) == 1  # nothing pending: no call
