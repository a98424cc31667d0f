"""SGLangBackend: the wire-format helpers run everywhere; the engine tests need a GPU and sglang.

The `gpu` tests have NOT been run in this project's CI (no GPU); they compare SGLang against the
torch backend on the same tiny random Qwen3 checkpoint.
"""

from __future__ import annotations

import pytest

from cleaner.engine.backends.base import LENGTH, STOP, SamplingParams
from cleaner.engine.backends.sglang_backend import (
    generation_from_output,
    input_logprobs_from_output,
    sampling_params_dict,
)

# ---------------------------------------------------------------------------- wire format (CPU)


def test_sampling_params_dict_stops_only_on_our_ids():
    params = SamplingParams(max_new_tokens=7, stop_token_ids=(3, 9), temperature=0.0, top_p=0.9)
    assert sampling_params_dict(params, seed=42) == {
        "max_new_tokens": 7, "stop_token_ids": [3, 9], "temperature": 0.0, "top_p": 0.9,
        "ignore_eos": True, "sampling_seed": 42,
    }


def test_generation_from_output_reads_ids_and_finish_reason():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(9,))
    stopped = {"meta_info": {
        "output_token_logprobs": [(-0.5, 4, None), (-1.25, 9, None)],
        "finish_reason": {"type": "stop", "matched": 9},
    }}
    generation = generation_from_output(stopped, params)
    assert generation.token_ids == (4, 9) and generation.logprobs == (-0.5, -1.25)
    assert generation.finish_reason == STOP
    full = {"meta_info": {
        "output_token_logprobs": [(-0.1, 1, None)] * 3, "finish_reason": {"type": "length", "length": 3},
    }}
    assert generation_from_output(full, params).finish_reason == LENGTH
    with pytest.raises(RuntimeError, match="aborted"):
        generation_from_output({"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}, params)


def test_input_logprobs_take_the_tail_and_check_ids():
    sequence = [5, 6, 7, 8]
    # asked with logprob_start_len = start - 1 = 1: entry for position 1 is the None placeholder
    output = {"meta_info": {"input_token_logprobs": [(None, 6, None), (-0.3, 7, None), (-0.7, 8, None)]}}
    assert input_logprobs_from_output(output, sequence, start=2) == [-0.3, -0.7]
    assert input_logprobs_from_output(output, sequence, start=4) == []
    with pytest.raises(RuntimeError, match="do not line up"):
        input_logprobs_from_output(output, [5, 6, 7, 9], start=2)
    with pytest.raises(RuntimeError, match="do not line up"):
        input_logprobs_from_output(output, sequence, start=1)  # would need the None entry


# ---------------------------------------------------------------------------- engine (GPU)


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir):
    return tiny_qwen3_dir


@pytest.fixture(scope="module")
def engines(model_dir):
    pytest.importorskip("sglang")
    from cleaner.engine.backends.sglang_backend import SGLangBackend
    from cleaner.engine.backends.torch_backend import TorchBackend

    sglang_backend = SGLangBackend(model_dir, dtype="float32", mem_fraction_static=0.3)
    yield sglang_backend, TorchBackend(model_dir, device="cuda")
    sglang_backend.shutdown()


@pytest.mark.gpu
def test_sglang_greedy_matches_torch(engines):
    sglang_backend, torch_backend = engines
    prompts = [[1, 5, 9, 13, 2], [3, 4]]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
    got = sglang_backend.generate(prompts, params, seeds=[0, 1])
    expected = torch_backend.generate(prompts, params, seeds=[0, 1])
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert all(g.finish_reason == LENGTH for g in got)


@pytest.mark.gpu
def test_sglang_score_matches_torch(engines):
    sglang_backend, torch_backend = engines
    sequences = [[1, 5, 9, 13, 2, 4, 4], [1, 5, 9, 13, 2, 7], [3, 4, 5]]
    starts = [5, 5, 1]
    got = sglang_backend.score(sequences, starts)
    expected = torch_backend.score(sequences, starts)
    for row_got, row_expected in zip(got, expected, strict=True):
        assert row_got == pytest.approx(row_expected, abs=1e-3)
