"""SGLangBackend (an in-process engine): without sglang installed, asking for it names the extra to
install; the engine options for CPU and GPUs; and, on the real SGLang runtime on CPU (`-m sglang`,
`make test-sglang`), greedy sampling equal to the torch backend's and the scorer's token counts
read from the engine's `cached_tokens`, against hand-counted values."""

from __future__ import annotations

import importlib.util
import os

import pytest

from cleaner.engine.model import load_backend, require_backend
from cleaner.engine.model.base import LENGTH, BackendError, SamplingParams
from cleaner.engine.model.sglang_engine import (
    CPU_ENGINE_ENV,
    engine_device,
    engine_options,
    import_sglang,
)
from cleaner.errors import CleanerError
from tests.helpers import assert_rows_close

no_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")


@no_sglang
def test_load_backend_without_sglang_names_the_extra(tiny_qwen3_dir):
    with pytest.raises(CleanerError, match=r"pip install 'cleaner\[sglang\]'"):
        load_backend("sglang", tiny_qwen3_dir, device="cuda")


@no_sglang
def test_asking_for_the_engine_on_cpu_sets_what_sglang_reads_at_import(monkeypatch):
    monkeypatch.delenv(CPU_ENGINE_ENV, raising=False)
    with pytest.raises(BackendError, match="not installed"):
        import_sglang("cpu")
    assert os.environ[CPU_ENGINE_ENV] == "1"


def test_a_server_url_needs_no_sglang_but_the_sglang_backend():
    require_backend("sglang", "http://127.0.0.1:30000")  # the server client is plain HTTP
    with pytest.raises(BackendError, match="--sglang-url http://h:1 needs --backend sglang"):
        require_backend("torch", "http://h:1")
    with pytest.raises(BackendError, match="backend must be one of"):
        require_backend("vllm")


def test_the_engine_runs_on_cpu_or_a_gpu():
    assert engine_device("cpu") == ("cpu", 0)
    assert engine_device("cuda") == ("cuda", 0) and engine_device("cuda:3") == ("cuda", 3)
    for device in ("cpu:1", "cuda:x", "mps"):
        with pytest.raises(BackendError, match="runs on cpu, cuda or cuda:N"):
            engine_device(device)


def test_engine_options_on_cpu_are_the_measured_recipe():
    assert engine_options("cpu", None, 7, {}) == {
        "skip_tokenizer_init": True, "random_seed": 7, "device": "cpu", "dtype": "float32",
        "attention_backend": "torch_native", "sampling_backend": "pytorch", "grammar_backend": "none",
        "disable_cuda_graph": True, "disable_overlap_schedule": True, "mem_fraction_static": 0.05,
        "max_total_tokens": 8192, "max_running_requests": 8, "chunked_prefill_size": -1,
        "sleep_on_idle": True, "log_level": "error", "enable_deterministic_inference": False,
    }
    assert engine_options("cpu", "bfloat16", 0, {"max_total_tokens": 4096})["max_total_tokens"] == 4096
    assert engine_options("cpu", "bfloat16", 0, {})["dtype"] == "bfloat16"


def test_engine_options_on_a_gpu_turn_deterministic_inference_and_the_memory_saver_on():
    assert engine_options("cuda:2", None, 5, {"tp_size": 2}) == {
        "skip_tokenizer_init": True, "random_seed": 5, "log_level": "warning", "base_gpu_id": 2,
        "dtype": "auto", "enable_deterministic_inference": True, "enable_memory_saver": True, "tp_size": 2,
    }


def test_engine_options_on_a_gpu_take_determinism_off_and_a_memory_fraction():
    options = engine_options("cuda", "bfloat16", 0, {}, deterministic=False, mem_fraction=0.6)
    assert (options["enable_deterministic_inference"], options["mem_fraction_static"], options["dtype"]) == (
        False, 0.6, "bfloat16")
    # on CPU neither applies: the CPU path's own KV budget and no deterministic kernels
    cpu = engine_options("cpu", None, 0, {}, deterministic=True, mem_fraction=0.6)
    assert (cpu["enable_deterministic_inference"], cpu["mem_fraction_static"]) == (False, 0.05)
    assert "enable_memory_saver" not in cpu


# ---------------------------------------------------------------------------- the real engine


@pytest.mark.sglang
def test_sglang_greedy_matches_torch(sglang_engine):
    from cleaner.engine.model.torch_backend import TorchBackend

    prompts = [[1, 5, 9, 13, 2], [3, 4]]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
    got = sglang_engine.generate(prompts, params, seeds=[0, 1])
    expected = TorchBackend(sglang_engine.model_path).generate(prompts, params, seeds=[0, 1])
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert all(g.finish_reason == LENGTH for g in got)
    for ours, theirs in zip(got, expected, strict=True):
        assert list(ours.logprobs) == pytest.approx(list(theirs.logprobs), abs=1e-4)


@pytest.mark.sglang
def test_the_scorer_reads_what_the_engine_computed_from_its_cached_tokens(sglang_engine):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    sequences = [prompt + [9, 9], prompt + [9, 8, 1], prompt + [1]]
    sglang_engine.engine.flush_cache()  # an empty radix cache, so every count below is exact
    scorer = sglang_engine.scorer()
    first = scorer.score_rows(sequences, [8, 8, 8])
    # requests (tests/engine/model/test_backend_scorer.py): the prompt alone, asked for its last
    # token (8 computed); prompt+[1] and prompt+[9] from position 8, their match capped at
    # logprob_start_len 7 (2 + 2); prompt+[9,8,1] and prompt+[9,9] from 9, capped at 8 (3 + 2)
    assert scorer.stats.tokens_computed == scorer.stats.tokens_forwarded == 8 + 2 + 2 + 3 + 2
    assert scorer.stats.tokens_naive == 10 + 11 + 9
    again = scorer.score_rows(sequences, [8, 8, 8])
    # everything is cached now; each request still computes from its logprob_start_len on
    assert scorer.stats.tokens_computed == 17 + (2 + 2 + 2 + 3 + 2)
    assert scorer.stats.tokens_naive == 2 * (10 + 11 + 9)
    assert_rows_close(again, first, atol=1e-6)
    assert_rows_close(first, sglang_engine.score(sequences, [8, 8, 8]), atol=1e-5)


@pytest.mark.sglang
def test_new_weights_whose_flush_was_refused_are_flushed_once_the_engine_is_idle(sglang_engine, tmp_path):
    """SGLang loads the weights, then refuses the flush while its scheduler still holds the last
    batch (seen in CI under load). The wrapped update returns exactly that refusal after the real
    load; adopt must complete it with a real flush, so nothing cached from the old weights is
    reused and the scores are the new weights'."""
    import torch

    from cleaner.engine.model.loading import load_policy
    from tests.helpers import naive_logprobs

    original = sglang_engine.model_path
    halved = load_policy(original, "cpu", torch.float32)
    halved.load_state_dict({k: v * 0.5 for k, v in halved.state_dict().items()})
    halved.save_pretrained(tmp_path / "halved")
    sequence = [11, 12, 13, 14, 15, 16, 17, 18, 9]
    sglang_engine.score([sequence], [4])  # cached now, under the old weights
    real_update = sglang_engine.engine.update_weights_from_disk

    def update_then_refuse_the_flush(path, *args, **kwargs):
        real_update(path, *args, **kwargs)
        return False, ("Weights were updated, but the cache was not flushed because requests are still "
                       "running or queued. Retract or finish them, then call /flush_cache."), 0

    sglang_engine.engine.update_weights_from_disk = update_then_refuse_the_flush
    try:
        sglang_engine.adopt(tmp_path / "halved")
        del sglang_engine.engine.update_weights_from_disk
        before = sglang_engine.tokens_computed
        (row,) = sglang_engine.score([sequence], [4])
        assert sglang_engine.tokens_computed - before == len(sequence)  # the cache was emptied
        assert row == pytest.approx(naive_logprobs(halved.eval(), sequence)[3:], abs=1e-4)
    finally:
        sglang_engine.engine.__dict__.pop("update_weights_from_disk", None)
        sglang_engine.adopt(original)
