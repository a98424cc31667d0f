"""kv.py: the cache-geometry probe, on a tiny Qwen3."""

from __future__ import annotations

import pytest
import torch

from cleaner.engine.model.kv import kv_geometry
from cleaner.engine.model.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    torch.set_num_threads(2)
    return TorchBackend(tiny_qwen3_dir).model


def test_kv_geometry_reads_layers_kv_heads_and_head_dim(model):
    config = model.config
    assert kv_geometry(model) == (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
