"""TorchBackend on a tiny random Qwen3: sampling properties, batching invariance, naive scoring."""

from __future__ import annotations

import math

import pytest
import torch

from cleaner.engine.model import load_backend
from cleaner.engine.model.base import LENGTH, STOP, SamplingParams
from cleaner.engine.model.torch_backend import TorchBackend, token_budget_batches
from cleaner.engine.model.torch_batching import draw_tokens, sampling_logprobs
from tests.helpers import naive_logprobs

PROMPTS = [[1, 5, 9, 13, 2], [3, 4], [7, 7, 7, 8, 9, 10, 11, 12, 20]]


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir):
    torch.set_num_threads(2)
    return tiny_qwen3_dir


@pytest.fixture(scope="module")
def backend(model_dir):
    return TorchBackend(model_dir)


# ---------------------------------------------------------------------------- sampling helpers


def test_top_p_keeps_smallest_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logprobs = sampling_logprobs(probs.log(), temperature=1.0, top_p=0.7)
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is {0, 1}, renormalised to 0.625 / 0.375
    assert torch.allclose(logprobs.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 0.0]])
    logprobs = sampling_logprobs(logits, temperature=2.0, top_p=1.0)
    assert logprobs[0, 0].item() == pytest.approx(1.0 - math.log(math.e + 1.0), abs=1e-6)


def test_inverse_cdf_picks_the_bucket_of_the_uniform():
    logprobs = torch.tensor([[0.25, 0.0, 0.75]]).log().expand(4, -1)
    tokens = draw_tokens(logprobs, torch.tensor([0.0, 0.2, 0.25, 0.99]))
    assert tokens.tolist() == [0, 0, 2, 2]  # the zero-probability token 1 is never drawn


def test_token_budget_batches_groups_longest_first():
    assert token_budget_batches([3, 10, 5, 5], max_batch_tokens=10) == [[1], [2, 3], [0]]


# ---------------------------------------------------------------------------- generate


def test_greedy_is_deterministic_and_ignores_seeds(backend):
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(), temperature=0.0)
    first = backend.generate(PROMPTS, params, seeds=[1, 2, 3])
    second = backend.generate(PROMPTS, params, seeds=[9, 9, 9])
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert all(len(g.token_ids) == 6 and g.finish_reason == LENGTH for g in first)


def test_same_seed_same_sample_different_seeds_differ(backend):
    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    a = backend.generate([PROMPTS[0]] * 3, params, seeds=[11, 11, 12])
    assert a[0].token_ids == a[1].token_ids
    assert a[0].logprobs == pytest.approx(a[1].logprobs, abs=1e-5)  # kernels differ per batch row
    assert a[0].token_ids != a[2].token_ids


def test_sample_does_not_depend_on_batch_neighbours(backend):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(), top_p=0.9)
    alone = backend.generate([PROMPTS[1]], params, seeds=[5])[0]
    batched = backend.generate(PROMPTS, params, seeds=[1, 5, 2])[1]
    assert alone.token_ids == batched.token_ids
    assert max(abs(x - y) for x, y in zip(alone.logprobs, batched.logprobs, strict=True)) < 1e-4


def test_padded_batch_equals_alone_at_temperature_zero(backend):
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
    batched = backend.generate(PROMPTS, params, seeds=[0, 0, 0])
    for prompt, in_batch in zip(PROMPTS, batched, strict=True):
        alone = backend.generate([prompt], params, seeds=[0])[0]
        assert alone.token_ids == in_batch.token_ids
        assert max(abs(x - y) for x, y in zip(alone.logprobs, in_batch.logprobs, strict=True)) < 1e-4


def test_stop_token_ends_generation_and_is_kept(backend):
    greedy = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
    reference = backend.generate([PROMPTS[2]], greedy, seeds=[0])[0].token_ids
    stop = reference[2]
    cut = reference.index(stop)  # the first occurrence may come before index 2
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(stop,), temperature=0.0)
    # the stopped row shares the batch with one that keeps going: rows finish independently
    stopped, other = backend.generate([PROMPTS[2], PROMPTS[0]], params, seeds=[0, 0])
    assert stopped.token_ids == reference[: cut + 1]
    assert stopped.finish_reason == STOP
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert other.finish_reason == LENGTH or other.token_ids[-1] == stop


def test_logprobs_at_temperature_one_match_naive_forward(backend):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=())
    generations = backend.generate(PROMPTS, params, seeds=[3, 4, 5])
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        expected = torch.tensor(naive_logprobs(backend.model, prompt + list(generation.token_ids))[len(prompt) - 1 :])
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_top_p_logprobs_are_renormalised(backend):
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(), top_p=0.5)
    generation = backend.generate([PROMPTS[0]], params, seeds=[8])[0]
    raw = torch.tensor(naive_logprobs(backend.model, PROMPTS[0] + list(generation.token_ids))[len(PROMPTS[0]) - 1 :])
    # renormalising over a nucleus of mass >= 0.5 raises every log-prob, by at most log 2
    gain = torch.tensor(generation.logprobs) - raw
    assert bool((gain >= -1e-5).all()) and bool((gain <= math.log(2) + 1e-5).all())


# ---------------------------------------------------------------------------- score, version


def test_score_matches_unpadded_forward(backend):
    sequences = [PROMPTS[0] + [4, 4, 6], PROMPTS[1], PROMPTS[2]]
    starts = [5, 1, 3]
    scored = backend.score(sequences, starts)
    for seq, start, row in zip(sequences, starts, scored, strict=True):
        assert len(row) == len(seq) - start
        assert torch.allclose(torch.tensor(row), torch.tensor(naive_logprobs(backend.model, seq)[start - 1 :]), atol=1e-5)


def test_score_rejects_bad_start(backend):
    with pytest.raises(ValueError, match="row 0: start 0"):
        backend.score([[1, 2]], [0])


def test_policy_version_names_dir_and_follows_weights(model_dir, tmp_path):
    backend = load_backend("torch", str(model_dir))
    assert backend.policy_version.startswith(f"{model_dir.name}@")
    assert backend.tokenizer is None
    changed = {k: v + 1.0 for k, v in backend.model.state_dict().items()}
    backend.model.load_state_dict(changed)
    backend.model.save_pretrained(tmp_path / model_dir.name)
    other = TorchBackend(tmp_path / model_dir.name)
    assert other.policy_version.split("@")[0] == model_dir.name
    assert other.policy_version != backend.policy_version


def test_set_weights_changes_outputs(model_dir):
    backend = TorchBackend(model_dir)
    before = backend.score([PROMPTS[0]], [1])[0]
    backend.set_weights({k: v * 0.5 for k, v in backend.model.state_dict().items()}, "half")
    assert backend.policy_version == "half"
    assert backend.score([PROMPTS[0]], [1])[0] != pytest.approx(before, abs=1e-3)


def test_set_weights_rejects_a_foreign_state_dict(model_dir):
    backend = TorchBackend(model_dir)
    with pytest.raises(ValueError, match="missing"):
        backend.set_weights({"model.norm.weight": torch.ones(32)}, "partial")


def test_adopt_after_training_in_place_keeps_the_model_and_names_the_checkpoint(model_dir, tmp_path):
    backend = TorchBackend(model_dir)
    model = backend.train_in_place()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    model.save_pretrained(tmp_path / "trained")
    backend.adopt(tmp_path / "trained")
    assert backend.model is model and not model.training  # no reload, back in eval mode
    assert backend.model_path == tmp_path / "trained"
    assert backend.policy_version == TorchBackend(tmp_path / "trained").policy_version


def test_adopt_without_training_in_place_loads_the_checkpoint(model_dir, tmp_path):
    backend = TorchBackend(model_dir)
    other = TorchBackend(model_dir)
    other.set_weights({k: v * 0.5 for k, v in other.model.state_dict().items()}, "half")
    other.model.save_pretrained(tmp_path / "half")
    before = backend.model
    backend.adopt(tmp_path / "half")
    assert backend.model is not before
    assert backend.score([PROMPTS[0]], [1])[0] == pytest.approx(other.score([PROMPTS[0]], [1])[0], abs=1e-6)


# ---------------------------------------------------------------------------- answers no policy gives


def test_a_forward_that_overflows_into_nan_is_a_bad_answer_never_a_generation(model_dir):
    """float16 rollouts are where NaN log-probs really come from: a model whose head gives NaN is
    refused at the backend (answers.py), by the batch and the request API alike, and so is its
    scoring for the IS gate."""
    import asyncio

    from cleaner.engine.model.answers import BadAnswer

    backend = TorchBackend(model_dir)
    try:
        with torch.no_grad():
            backend.model.lm_head.weight[3].fill_(float("nan"))  # one row: every logit vector holds a NaN
        params = SamplingParams(max_new_tokens=3, stop_token_ids=(), temperature=1.0)
        with pytest.raises(BadAnswer, match="not a finite number"):
            backend.generate([PROMPTS[0]], params, seeds=[1])

        async def one():
            return await backend.generate_async(PROMPTS[1], params, seed=2)

        with pytest.raises(BadAnswer, match="not a finite number|outside the vocabulary"):
            asyncio.run(one())

        async def score():
            return await backend.score_async([PROMPTS[0]], [1])

        with pytest.raises(BadAnswer, match="not log-probs"):
            asyncio.run(score())
    finally:
        backend.close()
