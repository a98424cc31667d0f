"""PrefixTrieScorer against a naive full forward per row, on a tiny random Qwen3 (docs/architecture.md §6)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen3ForCausalLM

from cleaner.engine.model.head import UnsupportedModelError
from cleaner.engine.model.radix import build_radix_tree, row_logprobs, tokens_to_forward
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.model.trie_scorer import PrefixTrieScorer
from tests.factories import SCORED_PROMPT, SCORING_CASES
from tests.helpers import assert_rows_close, naive_logprobs


@pytest.fixture(scope="module")
def backend(tiny_qwen3_dir):
    torch.set_num_threads(2)
    return TorchBackend(tiny_qwen3_dir)


def unpadded_reference(model, seq: list[int], start: int) -> list[float]:
    """One forward of one row, no batching at all: the scores from `start` on."""
    return naive_logprobs(model, seq)[start - 1 :]


# ---------------------------------------------------------------------------- radix tree


def test_radix_tree_shares_prefixes_and_splits_long_edges():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7]]
    root = build_radix_tree(rows, max_edge_tokens=8)
    assert sorted(child.edge for child in root.children) == [(1, 2), (7,)]
    shared = next(c for c in root.children if c.edge == (1, 2))
    assert shared.ending_rows == [2]  # row 2 is a prefix of rows 0 and 1
    (middle,) = shared.children
    assert middle.edge == (3,) and middle.depth == 2
    assert sorted(c.edge for c in middle.children) == [(4,), (5, 6)]
    chained = build_radix_tree([[1, 2, 3, 4, 5]], max_edge_tokens=2)
    edges, node = [], chained
    while node.children:
        (node,) = node.children
        edges.append((node.edge, node.depth))
    assert edges == [((1, 2), 0), ((3, 4), 2), ((5,), 4)]


def test_row_logprobs_reads_each_row_back_from_its_start():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7]]
    root = build_radix_tree(rows, max_edge_tokens=2)
    pending = list(root.children)
    while pending:  # each position's "log-prob" is its own index, so a row's read-back is plain
        node = pending.pop()
        node.logprobs = [float(node.depth + i) for i in range(len(node.edge))]
        pending.extend(node.children)
    assert row_logprobs(root, [1, 3, 1, 1]) == [[1.0, 2.0, 3.0], [3.0, 4.0], [1.0], []]


def test_pieces_grow_with_depth_so_copying_prefixes_stays_about_linear():
    """Each piece's attention batch copies its prefix cache: with pieces of a fixed 8 tokens, a 3,000
    token row copies 3,000^2 / 16 = 562k prefix tokens; pieces of a sixteenth of their depth (at most
    64) copy a small fraction of that."""
    root = build_radix_tree([list(range(3000))], max_edge_tokens=8)
    pieces, node = [], root
    while node.children:
        (node,) = node.children
        pieces.append((node.depth, len(node.edge)))
    assert pieces[0] == (0, 8) and all(size == 8 for depth, size in pieces if depth < 144)
    assert all(size == min(max(8, depth // 16), 64) for depth, size in pieces[:-1])
    assert sum(size for _, size in pieces) == 3000
    copied = sum(depth for depth, _ in pieces)
    assert copied < 562_000 / 5
    capped = build_radix_tree([list(range(3000))], max_edge_tokens=8, max_piece_tokens=20)  # a GPU's budget
    sizes, node = [], capped
    while node.children:
        (node,) = node.children
        sizes.append(len(node.edge))
    assert max(sizes) == 20 and sum(sizes) == 3000


# ---------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("case", list(SCORING_CASES))
def test_trie_equals_naive_full_forward(backend, case):
    sequences, starts = SCORING_CASES[case]
    scorer = PrefixTrieScorer(backend.model, max_batch_tokens=64, max_edge_tokens=16)
    got = scorer.score_rows(sequences, starts)
    expected = [unpadded_reference(backend.model, s, p) for s, p in zip(sequences, starts, strict=True)]
    assert_rows_close(got, expected)
    assert_rows_close(got, backend.score(sequences, starts))


def test_trie_forwards_each_distinct_position_once(backend):
    sequences = [SCORED_PROMPT + [3, 4, 5, 6], SCORED_PROMPT + [3, 4, 7], SCORED_PROMPT + [9]]
    scorer = PrefixTrieScorer(backend.model)
    scorer.score_rows(sequences, [8, 8, 8])
    # distinct positions: the 8-token prompt, then 3 and 4 shared, then 5, 6 | 7 | 9; a row's
    # last token is context for nothing, so 6, 7 and 9 are never forwarded
    assert scorer.stats.tokens_forwarded == 8 + 2 + 1
    assert scorer.stats.tokens_naive == 12 + 11 + 9
    assert scorer.stats.n_prefix_groups == 2  # the prompt node and the [3, 4] node


def test_each_attention_batchs_buffers_are_made_on_the_scorers_device(backend, monkeypatch):
    """What the CPU can see of the GPU path: every attention batch of every forward is built for
    the scorer's own device (on a GPU, a batch built elsewhere would meet its keys on the wrong device),
    and attends with the scorer's choice of grouped-query kernels (repeating K/V gives the same
    values, at a head-count times the memory)."""
    from cleaner.engine.model import trie_scorer
    from cleaner.engine.model.trie_attention import AttentionBatch

    built, grouped, original, attention = [], [], AttentionBatch.of, trie_scorer.packed_attention
    monkeypatch.setattr(AttentionBatch, "of", staticmethod(
        lambda items, first, geometry, dtype, device: built.append(device) or original(items, first, geometry, dtype,
                                                                                       device)))
    monkeypatch.setattr(trie_scorer, "packed_attention",
                        lambda model, groups, gqa: grouped.append(gqa) or attention(model, groups, gqa))
    for gqa in (True, False):
        scorer = PrefixTrieScorer(backend.model)
        scorer.grouped_query = gqa
        scorer.score_rows([SCORED_PROMPT + [3, 4, 5], SCORED_PROMPT + [9, 10]], [8, 8])
    assert built and built == [scorer.device] * len(built)
    assert grouped[0] is True and grouped[-1] is False and set(grouped) == {True, False}


def test_a_forward_of_few_parents_among_leaves_copies_the_parents_caches_out(backend):
    """root -> SCORED_PROMPT -> {[3, 4, 5] -> {a, b}, two leaves}: the second forward holds one
    parent among three edges, so its cache rows are copied out of the batch's buffer (the leaves'
    share freed) and its children read their prefix from the copy: the naive forward's values."""
    sequences = [SCORED_PROMPT + [3, 4, 5, 20, 21], SCORED_PROMPT + [3, 4, 5, 22, 23],
                 SCORED_PROMPT + [9, 11, 12], SCORED_PROMPT + [10, 13, 14]]
    scorer = PrefixTrieScorer(backend.model)
    got = scorer.score_rows(sequences, [8, 8, 8, 8])
    assert scorer.stats.n_forwards == 3 and scorer.stats.n_prefix_groups == 2  # the prompt and [3, 4, 5]
    assert_rows_close(got, [unpadded_reference(backend.model, s, 8) for s in sequences])


def test_edges_of_different_parents_and_depths_share_one_forward(backend):
    # root -> SCORED_PROMPT -> {[3..7] -> {a, b}, [9] -> {c, d}}: the four leaves hang at depths 13 and 9
    sequences = [SCORED_PROMPT + [3, 4, 5, 6, 7, 20, 21], SCORED_PROMPT + [3, 4, 5, 6, 7, 22, 23],
                 SCORED_PROMPT + [9, 24, 25, 26], SCORED_PROMPT + [9, 27, 28]]
    scorer = PrefixTrieScorer(backend.model)
    got = scorer.score_rows(sequences, [8, 8, 8, 8])
    assert scorer.stats.n_forwards == 3  # SCORED_PROMPT; both inner edges; all four leaves at once
    expected = [unpadded_reference(backend.model, s, 8) for s in sequences]
    assert_rows_close(got, expected)


def test_tiny_budgets_chunk_and_chain_without_changing_results(backend):
    rng = random.Random(7)
    prompt = [rng.randrange(64) for _ in range(30)]
    sequences = []
    for _ in range(6):
        shared = rng.randrange(0, 6)
        sequences.append(prompt + sequences[-1][30 : 30 + shared] if sequences else list(prompt))
        sequences[-1] = sequences[-1] + [rng.randrange(64) for _ in range(rng.randrange(1, 12))]
    starts = [30] * len(sequences)
    small = PrefixTrieScorer(backend.model, max_batch_tokens=12, max_edge_tokens=4)
    assert_rows_close(small.score_rows(sequences, starts), backend.score(sequences, starts))
    assert small.stats.n_forwards > len(sequences)  # the budget really forced chunks and chains


def test_bfloat16_is_close_to_float32(backend):
    sequences, starts = SCORING_CASES["identical up to a divergence"]
    model = Qwen3ForCausalLM(backend.model.config).to(torch.bfloat16)
    model.load_state_dict(backend.model.state_dict())
    got = PrefixTrieScorer(model.eval()).score_rows(sequences, starts)
    assert_rows_close(got, backend.score(sequences, starts), atol=0.1)


def test_eager_attention_model_gives_the_same_rows(backend):
    sequences, starts = SCORING_CASES["identical up to a divergence"]
    config = backend.model.config.__class__.from_dict(backend.model.config.to_dict())
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config)
    model.load_state_dict(backend.model.state_dict())
    scorer = PrefixTrieScorer(model.eval(), max_batch_tokens=64, max_edge_tokens=4)
    assert_rows_close(scorer.score_rows(sequences, starts), backend.score(sequences, starts))
    assert model.config._attn_implementation == "eager"


def test_key_values_repeated_per_head_give_the_same_rows(backend):
    # the CUDA path: no enable_gqa, K/V repeated per query head (the tiny model has 4 heads, 2 K/V heads)
    sequences, starts = SCORING_CASES["identical up to a divergence"]
    scorer = PrefixTrieScorer(backend.model, max_batch_tokens=64, max_edge_tokens=4)
    scorer.grouped_query = False
    assert_rows_close(scorer.score_rows(sequences, starts), backend.score(sequences, starts))


def test_the_model_keeps_its_attention_after_scoring_and_after_a_failed_forward(backend):
    sequences, starts = SCORING_CASES["shared prompt, different responses"]
    before = backend.score(sequences, starts)
    scorer = PrefixTrieScorer(backend.model)
    scorer.score_rows(sequences, starts)
    with pytest.raises(IndexError):  # a token outside the vocabulary fails inside the forward
        scorer.score_rows([SCORED_PROMPT + [10**6, 3]], [8])
    assert backend.model.config._attn_implementation == "sdpa"
    assert_rows_close(backend.score(sequences, starts), before, atol=0.0)


def test_sliding_window_layers_work_inside_the_window_and_refuse_beyond_it(backend):
    config = backend.model.config.__class__.from_dict(
        {**backend.model.config.to_dict(), "use_sliding_window": True, "sliding_window": 12, "max_window_layers": 0,
         "layer_types": None})
    model = Qwen3ForCausalLM(config)
    model.load_state_dict(backend.model.state_dict())
    model.eval()
    assert model.model.layers[0].self_attn.sliding_window == 12
    short = [SCORED_PROMPT + [3, 4, 5], SCORED_PROMPT + [3, 9]]  # at most 11 tokens: attention is plain causal
    got = PrefixTrieScorer(model, max_batch_tokens=64, max_edge_tokens=4).score_rows(short, [8, 8])
    assert_rows_close(got, [unpadded_reference(model, s, 8) for s in short])
    with pytest.raises(UnsupportedModelError, match="sliding window of 12 tokens .config layer_types, sliding_window."):
        PrefixTrieScorer(model).score_rows([SCORED_PROMPT + list(range(3, 13))], [8])  # before any forward
    assert model.config._attn_implementation == "sdpa"


def test_the_chunked_head_equals_a_naive_forward_at_the_real_vocabulary(monkeypatch):
    """At Qwen's 151,936-token vocabulary the head runs 64 positions at a time (never all the
    positions' logits at once) and the log-probs equal a naive float32 forward's within 1e-5."""
    import cleaner.engine.model.head as head
    from tests.helpers import tiny_qwen3

    model = tiny_qwen3(seed=3, vocab_size=151_936).eval()
    rng = random.Random(1)
    prompt = [rng.randrange(151_936) for _ in range(40)]
    rows = [prompt + [rng.randrange(151_936) for _ in range(length)] for length in (260, 300, 120)]
    rows.append(rows[1][:200] + [rng.randrange(151_936) for _ in range(50)])  # shares a prefix with row 1
    chunks = []
    original = head.chunk_logits
    monkeypatch.setattr(head, "chunk_logits", lambda hidden, *a: chunks.append(hidden.shape[0]) or original(hidden, *a))
    got = PrefixTrieScorer(model, max_batch_tokens=512, max_edge_tokens=64, chunk_tokens=64).score_rows(
        rows, [40] * len(rows))
    # each needed position once: the last row shares 200 tokens (160 of them scored) with row 1
    assert max(chunks) == 64 and sum(chunks) == sum(len(r) for r in got) - 160 == 730
    assert_rows_close(got, [unpadded_reference(model, row, 40) for row in rows], atol=1e-5)


def test_rejects_a_model_whose_logits_are_not_a_plain_head(backend):
    backend.model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(UnsupportedModelError, match="final_logit_softcapping = 30.0"):
            PrefixTrieScorer(backend.model)
    finally:
        del backend.model.config.final_logit_softcapping


def test_rejects_a_model_whose_attention_takes_no_4d_mask(backend):
    backend.model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="'sdpa' or 'eager'"):
            PrefixTrieScorer(backend.model)
    finally:
        backend.model.config._attn_implementation = "sdpa"


def test_rejects_start_outside_row(backend):
    with pytest.raises(ValueError, match="row 1: start 4 outside"):
        PrefixTrieScorer(backend.model).score_rows([[1, 2], [1, 2, 3]], [1, 4])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=8),
    data=st.data(),
)
def test_trie_equals_naive_on_random_small_alphabet_rows(backend, rows, data):
    # a 4-token alphabet makes shared prefixes, duplicates and prefix-of-another rows common
    starts = [data.draw(st.integers(1, len(row))) for row in rows]
    scorer = PrefixTrieScorer(backend.model, max_batch_tokens=48, max_edge_tokens=4)
    assert_rows_close(scorer.score_rows(rows, starts), backend.score(rows, starts))
    # every distinct proper prefix's last position once; nothing else
    assert scorer.stats.tokens_forwarded == len({tuple(row[: t + 1]) for row in rows for t in range(len(row) - 1)})
    assert scorer.stats.tokens_forwarded == tokens_to_forward(build_radix_tree(rows, 4))  # the progress bar's total


def test_a_gpu_scorer_sizes_its_batches_from_a_memory_budget(backend, monkeypatch):
    """On a GPU the attention batches hold at most half of what a naive forward of the longest row
    would (its float32 logits and its cache), within 80% of the free memory, or a budget given,
    rounded down to 256 tokens, between 512 and 8192; pieces at most 2048. Worked by hand on the
    tiny model (the device stood in for: sizes only): a position's float32 keys and values take
    2 (K, V) x 2 layers x 2 heads x 8 dims x 4 bytes = 256 bytes and its logits 64 x 4 = 256, so a
    naive pass holds 512 bytes a position; a batch token costs 2 x (4 window batches + 1) x 256 =
    2,560 bytes of budget."""
    scorer = PrefixTrieScorer(backend.model, device="cpu")
    assert scorer.geometry == (2, 2, 8) and scorer.window_batches == 4
    free, asked = {"bytes": 10**12}, []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (free["bytes"], 10**12))
    # 20,480 x 512 / 2 = 5,242,880 bytes: 2,048 tokens exactly
    assert scorer._sizes(20_480) == (2048, 2048)
    # 15,000 x 512 / 2 = 3,840,000 bytes: 1,500 tokens, rounded down to 1,280
    assert scorer._sizes(15_000) == (1280, 1280)
    # 400,000 x 512 / 2 buys 40,000 tokens: the largest batch, and pieces of 2,048
    assert scorer._sizes(400_000) == (8192, 2048)
    free["bytes"] = 5_000_000  # 80% of it, 4,000,000 bytes, is less than the 5,242,880 asked: 1,562 -> 1,536
    assert scorer._sizes(20_480) == (1536, 1536)
    free["bytes"] = 10**12
    scorer.memory_bytes = 2560 * 1024  # a budget given: 1,024 tokens, whatever the row
    assert scorer._sizes(400_000) == (1024, 1024)
    free["bytes"] = 0  # nothing free: the smallest batch
    assert scorer._sizes(400_000) == (512, 512)
    assert asked == [scorer.device] * 6  # the scorer's own device's free memory, not the current device's
    scorer.memory_bytes, free["bytes"] = None, 10**12  # token counts, as range() and slicing take them: ints
    assert all(type(size) is int for longest in (15_000, 20_480, 400_000) for size in scorer._sizes(longest))


def test_a_scorer_for_a_gpu_takes_the_gpu_sizes_unless_it_is_given_sizes(backend):
    """What the CPU can see of the CUDA path: built for a CUDA device (nothing is allocated there
    until a forward), the scorer takes batches of 8,192 and pieces of 2,048 tokens, sized by the
    memory budget at each call unless sizes are given, and repeats K/V per query head (no
    enable_gqa); on the CPU, 2,048 and 64, never budgeted."""
    from cleaner.engine.model.trie_attention import TORCH_GQA

    gpu = PrefixTrieScorer(backend.model, device="cuda", memory_bytes=10**9)
    assert (gpu.max_batch_tokens, gpu.max_edge_tokens, gpu.budgeted, gpu.grouped_query) == (8192, 2048, True, False)
    assert gpu.memory_bytes == 10**9 and gpu.device == torch.device("cuda")
    assert PrefixTrieScorer(backend.model, device="cuda", max_batch_tokens=4096).budgeted is False
    assert PrefixTrieScorer(backend.model, device="cuda", max_edge_tokens=1024).budgeted is False
    cpu = PrefixTrieScorer(backend.model)
    assert (cpu.max_batch_tokens, cpu.max_edge_tokens, cpu.budgeted, cpu.grouped_query) == (2048, 64, False, TORCH_GQA)
    assert cpu.memory_bytes is None and cpu.device == torch.device("cpu") and cpu.dtype == torch.float32


def test_a_head_with_a_bias_is_scored_with_it(backend):
    """An output head with a bias (a plain Linear, as some architectures have) scores as the model's
    own forward does, bias included."""
    import copy

    model = copy.deepcopy(backend.model)
    weight = model.lm_head.weight
    model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
        model.lm_head.bias.copy_(torch.linspace(-2.0, 2.0, weight.shape[0]))
    sequences = [SCORED_PROMPT + [3, 4, 5], SCORED_PROMPT + [9, 10]]
    got = PrefixTrieScorer(model).score_rows(sequences, [8, 8])
    assert_rows_close(got, [unpadded_reference(model, s, 8) for s in sequences])


def test_a_scorers_index_tensors_are_made_on_its_device(backend):
    """The positions, ids and picks a forward indexes with go to the scorer's device (on a GPU, CPU
    indices would fail the forward): on the meta device, which every machine has."""
    assert PrefixTrieScorer(backend.model, device="meta")._long([3, 1, 2]).device.type == "meta"
    assert PrefixTrieScorer(backend.model)._long(iter([3, 1, 2])).tolist() == [3, 1, 2]


def test_sizes_that_cannot_hold_a_piece_are_refused(backend):
    equal = PrefixTrieScorer(backend.model, max_batch_tokens=16, max_edge_tokens=16, window_batches=1)
    assert (equal.max_batch_tokens, equal.max_edge_tokens, equal.window_batches) == (16, 16, 1)
    with pytest.raises(ValueError, match="^max_edge_tokens must be <= max_batch_tokens$"):
        PrefixTrieScorer(backend.model, max_batch_tokens=16, max_edge_tokens=17)
    with pytest.raises(ValueError, match="^max_edge_tokens must be <= max_batch_tokens$"):
        PrefixTrieScorer(backend.model, max_batch_tokens=32)  # the CPU's 64-token pieces
    with pytest.raises(ValueError, match="^window_batches must be >= 1$"):
        PrefixTrieScorer(backend.model, window_batches=0)


def _pending(name: str, depth: int, forward_length: int):
    from types import SimpleNamespace

    from cleaner.engine.model.trie_scorer import _Pending

    return _Pending(SimpleNamespace(name=name, depth=depth, forward_length=forward_length), None, 0.0)


def test_a_window_takes_edges_off_the_stack_until_their_tokens_reach_it():
    """The window bounds what one round of forwards holds at once (a GPU's memory): prefix + edge
    tokens, summed, worked by hand; the top edge goes in whatever its size."""
    from cleaner.engine.model.trie_scorer import _cost, _take_window

    def stack():  # costs (depth + edge tokens), bottom to top: 1, 5, 4, 3
        return [_pending("d", 0, 1), _pending("a", 2, 3), _pending("b", 0, 4), _pending("c", 1, 2)]

    assert [_cost(item) for item in stack()] == [1, 5, 4, 3]
    for window_tokens, taken, left in [(12, "cba", "d"), (11, "cb", "da"), (13, "cbad", ""), (2, "c", "dab")]:
        rest = stack()
        window = _take_window(rest, window_tokens)
        assert ("".join(i.node.name for i in window), "".join(i.node.name for i in rest)) == (taken, left), window_tokens


def test_edges_are_batched_longest_first_so_rows_times_the_longest_prefix_and_edge_fit_the_budget():
    """Sorted by edge tokens then prefix, longest first, and grouped while (rows) x (longest prefix
    + longest edge) stays within the budget, as worked by hand; a batch of one may exceed it."""
    from cleaner.engine.model.trie_scorer import _batches

    window = [_pending("p", 4, 2), _pending("q", 0, 6), _pending("r", 2, 2), _pending("s", 1, 6)]
    # order s (1, 6), q (0, 6), p (4, 2), r (2, 2); s+q: 2 x 7 = 14; +p: 3 x 10 = 30; p+r: 2 x 6 = 12
    for budget, expected in [(20, ["sq", "pr"]), (14, ["sq", "pr"]), (13, ["s", "q", "pr"]), (12, ["s", "q", "pr"]),
                             (11, ["s", "q", "p", "r"]), (30, ["sqp", "r"]), (40, ["sqpr"]), (1, ["s", "q", "p", "r"])]:
        batches = _batches(list(window), budget)
        assert ["".join(i.node.name for i in batch) for batch in batches] == expected, budget
