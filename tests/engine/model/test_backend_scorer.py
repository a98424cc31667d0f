"""BackendScorer (one request per radix-tree edge, level by level) over the torch backend's naive
`score`: the rows it returns equal scoring each row whole, and the requests it makes are the
hand-counted ones an engine's prefix cache can serve from the parent's path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cleaner.engine.model.backend_scorer import BackendScorer
from cleaner.engine.model.torch_backend import TorchBackend
from tests.factories import SCORED_PROMPT, SCORING_CASES
from tests.helpers import assert_rows_close


@pytest.fixture(scope="module")
def backend(tiny_qwen3_dir):
    torch.set_num_threads(2)
    return TorchBackend(tiny_qwen3_dir)


class Recording:
    """The torch backend's `score`, remembering each call's (sequence, start) requests."""

    def __init__(self, backend: TorchBackend) -> None:
        self.backend, self.calls = backend, []

    def __call__(self, sequences, starts):
        self.calls.append([(tuple(s), p) for s, p in zip(sequences, starts, strict=True)])
        return self.backend.score(sequences, starts)


def test_backend_scorer_restores_row_order(backend):
    sequences = [SCORED_PROMPT + [9, 9], [3, 2, 1], SCORED_PROMPT + [1]]
    starts = [8, 1, 8]
    got = BackendScorer(backend.score).score_rows(sequences, starts)
    assert_rows_close(got, backend.score(sequences, starts), atol=1e-6)


@pytest.mark.parametrize("case", list(SCORING_CASES))
def test_backend_scorer_equals_scoring_each_row(backend, case):
    sequences, starts = SCORING_CASES[case]
    assert_rows_close(BackendScorer(backend.score).score_rows(sequences, starts),
                      backend.score(sequences, starts), atol=1e-5)


def test_one_request_per_edge_level_by_level(backend):
    sequences = [SCORED_PROMPT + [9, 9], SCORED_PROMPT + [9, 8, 1], SCORED_PROMPT + [1]]
    recording = Recording(backend)
    scorer = BackendScorer(recording)
    got = scorer.score_rows(sequences, [8, 8, 8])
    assert_rows_close(got, backend.score(sequences, [8, 8, 8]), atol=1e-6)
    # the shared SCORED_PROMPT holds no wanted position (all starts are 8) but branches: it is sent first,
    # asking for its last token only, so it is cached; its two children go in the next call,
    # their children in the one after, each scored from its own edge on
    assert recording.calls == [
        [(tuple(SCORED_PROMPT), 7)],
        [(tuple(SCORED_PROMPT + [1]), 8), (tuple(SCORED_PROMPT + [9]), 8)],
        [(tuple(SCORED_PROMPT + [9, 8, 1]), 9), (tuple(SCORED_PROMPT + [9, 9]), 9)],
    ]
    assert scorer.stats.n_forwards == 5
    assert scorer.stats.n_prefix_groups == 2  # SCORED_PROMPT and SCORED_PROMPT + [9]
    # the SCORED_PROMPT whole, then each edge and the token before it (logprob_start_len caps the match)
    assert scorer.stats.tokens_forwarded == 8 + 2 + 2 + 2 + 3
    assert scorer.stats.tokens_naive == 10 + 11 + 9


def test_an_engine_count_of_computed_tokens_fills_the_stats(backend):
    engine_count = iter([100, 117, 117, 130])  # what the engine said it had computed, before and after
    scorer = BackendScorer(backend.score, computed=lambda: next(engine_count))
    assert scorer.stats.tokens_computed is None
    scorer.score_rows([SCORED_PROMPT + [9, 9]], [8])
    assert scorer.stats.tokens_computed == 17
    scorer.score_rows([SCORED_PROMPT + [1]], [8])
    assert scorer.stats.tokens_computed == 17 + 13
    assert scorer.stats.tokens_naive == 10 + 9  # the stats' naive count stays the rows', not the engine's


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=8),
    data=st.data(),
)
def test_backend_scorer_equals_naive_on_random_small_alphabet_rows(backend, rows, data):
    starts = [data.draw(st.integers(1, len(row))) for row in rows]
    recording = Recording(backend)
    assert_rows_close(BackendScorer(recording).score_rows(rows, starts), backend.score(rows, starts))
    # no position is asked for twice, across requests and calls
    asked = [sequence[: t + 1] for call in recording.calls for sequence, start in call
             for t in range(start, len(sequence))]
    assert len(asked) == len(set(asked))
