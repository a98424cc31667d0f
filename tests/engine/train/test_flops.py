"""Model FLOPs utilisation (engine/train/flops.py) against verl's FlopsCounter formula for the
Qwen2/Qwen3 family (verl/utils/flops_counter.py, v0.7.0: `_estimate_qwen2_flops` and
`get_device_flops`), worked by hand on Qwen3-4B's config: rows of 16,384 and 4,096 tokens, 2.82 s
a step on an H100 (the first GPU run's step)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

from cleaner.engine.train.flops import model_flops_utilisation, peak_tflops, step_flops

# Qwen3-4B's config.json: hidden 2560, intermediate 9728, 36 layers, 32 heads of 128, 8 KV heads,
# vocabulary 151,936, tied embeddings
QWEN3_4B = Qwen3Config(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
ROWS = [16_384, 4_096]


def test_a_qwen3_4b_step_as_verls_flops_counter_counts_it():
    mlp = 2560 * 9728 * 3  # gate, up, down
    attention_linear = 2560 * (32 * 128 + 8 * 128 + 8 * 128 + 32 * 128)  # q, k, v, o
    embeddings = 151_936 * 2560 * 2  # both, although tied
    dense = (mlp + attention_linear) * 36 + embeddings
    assert dense == 4_411_228_160  # not the 4,022,468,096 parameters: norms out, the tied embedding twice
    attention = 12 * (16_384**2 + 4_096**2) * 128 * 32 * 36  # the full square, no causal half
    flops = 6 * dense * 20_480 + attention
    assert step_flops(QWEN3_4B, ROWS) == pytest.approx(flops, rel=1e-12)
    assert flops / 2.82 / 1e12 == pytest.approx(371.2, abs=0.1)  # TFLOP/s as verl counts them (6NT + causal: 264.8)
    mfu = model_flops_utilisation(QWEN3_4B, ROWS, 2.82, "NVIDIA H100 80GB HBM3")
    assert mfu == pytest.approx(flops / 2.82 / 989e12) and mfu == pytest.approx(0.3753, abs=1e-4)


def test_the_head_dim_defaults_to_hidden_over_heads_and_llama_counts_alike():
    llama = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    dense = (64 * 128 * 3 + 64 * (64 + 32 + 32 + 64)) * 2 + 1000 * 64 * 2
    assert step_flops(llama, [10, 3]) == pytest.approx(6 * dense * 13 + 12 * (100 + 9) * 16 * 4 * 2)


def test_a_family_verl_does_not_count_densely_gets_no_figure():
    moe = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert step_flops(moe, [10]) is None
    assert model_flops_utilisation(moe, [10], 1.0, "NVIDIA H100 80GB HBM3") is None


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 989.0),
                                            ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0),
                                            ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.05),
                                            ("NVIDIA L40", 181.05), ("NVIDIA GB200", 2500.0), ("NVIDIA B200", 2250.0),
                                            ("NVIDIA L4", None), ("Tesla T4", None)])
def test_the_peak_is_verls_by_the_devices_name_and_none_when_unknown(name, peak):
    assert peak_tflops(name) == peak
    if peak is None:
        assert model_flops_utilisation(QWEN3_4B, [1024], 1.0, name) is None
