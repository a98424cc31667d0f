"""kv.py: a forward on a BufferCache equals one on a DynamicCache and leaves the whole path in the buffer."""

from __future__ import annotations

import pytest
import torch

from cleaner.engine.backends.kv import BufferCache, causal_forward
from cleaner.engine.backends.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    torch.set_num_threads(2)
    return TorchBackend(tiny_qwen3_dir).model


def _forward(model, tokens, past, past_length):
    ids = torch.tensor([tokens])
    mask = torch.ones(1, past_length + len(tokens), dtype=torch.long)
    positions = torch.arange(past_length, past_length + len(tokens))[None]
    return causal_forward(model, ids, mask, positions, past=past)


@torch.inference_mode()
def test_buffer_cache_forward_equals_dynamic_cache_and_holds_the_path(model):
    prefix, suffix = [1, 5, 9, 13, 2, 7], [3, 4, 8]
    first = _forward(model, prefix, None, 0)
    on_dynamic = _forward(model, suffix, first.kv, len(prefix))
    keys, _ = first.kv[0]  # (1, H, T, D)
    buffer = keys.new_full((len(first.kv), 2, 1, keys.shape[1], len(prefix) + len(suffix), keys.shape[-1]), float("nan"))
    for layer, (k, v) in enumerate(first.kv):
        buffer[layer, 0, :, :, : len(prefix)] = k
        buffer[layer, 1, :, :, : len(prefix)] = v
    on_buffer = _forward(model, suffix, BufferCache(buffer, len(prefix)), len(prefix))
    torch.testing.assert_close(on_buffer.logits, on_dynamic.logits, rtol=0, atol=1e-6)
    assert not buffer.isnan().any()  # every position written: the buffer is the whole path's cache
    for layer, (k, v) in enumerate(on_dynamic.kv):
        torch.testing.assert_close(buffer[layer, 0], k, rtol=0, atol=1e-6)
        torch.testing.assert_close(buffer[layer, 1], v, rtol=0, atol=1e-6)


@torch.inference_mode()
def test_buffer_cache_refuses_to_overflow(model):
    first = _forward(model, [1, 5, 9], None, 0)
    keys, _ = first.kv[0]
    buffer = keys.new_zeros((len(first.kv), 2, 1, keys.shape[1], 4, keys.shape[-1]))
    with pytest.raises(ValueError, match="holds 4 positions"):
        _forward(model, [3, 4], BufferCache(buffer, 3), 3)
