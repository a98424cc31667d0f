"""Helpers shared by test files (fixtures that use them live in conftest.py)."""

from __future__ import annotations

import torch


def tiny_qwen3(seed: int = 0, vocab_size: int = 64, num_hidden_layers: int = 2, **overrides):
    """A random-weight Qwen3ForCausalLM small enough to forward in milliseconds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=512, **overrides,
    )
    return Qwen3ForCausalLM(config)
