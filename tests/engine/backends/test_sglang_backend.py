"""SGLangBackend (an in-process engine): without sglang installed, asking for it names the extra to
install; on a GPU with sglang, it samples greedily what the torch backend samples. The `gpu` case
has NOT run in this project's CI (no GPU there)."""

from __future__ import annotations

import importlib.util

import pytest

from cleaner.engine.backends import load_backend, require_backend
from cleaner.engine.backends.base import LENGTH, BackendError, SamplingParams
from cleaner.engine.backends.sglang_backend import gpu_index
from cleaner.errors import CleanerError

no_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")


@no_sglang
def test_load_backend_without_sglang_names_the_extra(tiny_qwen3_dir):
    with pytest.raises(CleanerError, match=r"pip install 'cleaner\[sglang\]'"):
        load_backend("sglang", tiny_qwen3_dir, device="cuda")


def test_a_server_url_needs_no_sglang_but_the_sglang_backend():
    require_backend("sglang", "http://127.0.0.1:30000")  # the server client is plain HTTP
    with pytest.raises(BackendError, match="--sglang-url http://h:1 needs --backend sglang"):
        require_backend("torch", "http://h:1")
    with pytest.raises(BackendError, match="backend must be one of"):
        require_backend("vllm")


def test_the_engine_device_is_a_gpu():
    assert gpu_index("cuda") == 0 and gpu_index("cuda:3") == 3
    for device in ("cpu", "cuda:x", "mps"):
        with pytest.raises(BackendError, match="runs on a CUDA GPU"):
            gpu_index(device)


@pytest.mark.gpu
def test_sglang_greedy_matches_torch(tiny_qwen3_dir):
    pytest.importorskip("sglang")
    from cleaner.engine.backends.sglang_backend import SGLangBackend
    from cleaner.engine.backends.torch_backend import TorchBackend

    sglang_backend = SGLangBackend(tiny_qwen3_dir, device="cuda", dtype="float32", mem_fraction_static=0.3)
    try:
        prompts = [[1, 5, 9, 13, 2], [3, 4]]
        params = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
        got = sglang_backend.generate(prompts, params, seeds=[0, 1])
        expected = TorchBackend(tiny_qwen3_dir, device="cuda").generate(prompts, params, seeds=[0, 1])
        assert [g.token_ids for g in got] == [g.token_ids for g in expected]
        assert all(g.finish_reason == LENGTH for g in got)
    finally:
        sglang_backend.close()
