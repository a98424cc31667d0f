"""Model FLOPs utilisation (engine/train/flops.py), worked by hand against the figure the first GPU
run measured: Qwen3-4B, rows of 16,384 and 4,096 tokens, 2.82 s a step with AdamW on an H100,
about 265 TFLOP/s of model work, 27% of its 989."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from cleaner.engine.train.flops import model_flops_utilisation, peak_tflops, step_flops
from cleaner.engine.train.memory import parameter_count

QWEN3_4B = Qwen3Config(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def test_a_4b_step_by_hand():
    parameters = parameter_count(QWEN3_4B)
    assert parameters == 4_022_468_096  # Qwen3-4B, its tied embedding counted once
    rows = [16_384, 4_096]
    dense = 6 * parameters * 20_480
    attention = 6 * 36 * 32 * 128 * (16_384**2 + 4_096**2)  # causal: half of QK^T and AV, forward and backward
    assert step_flops(QWEN3_4B, parameters, rows) == pytest.approx(dense + attention, rel=1e-12)
    assert (dense + attention) / 2.82 / 1e12 == pytest.approx(264.8, abs=0.1)
    assert model_flops_utilisation(QWEN3_4B, parameters, rows, 2.82, "NVIDIA H100 80GB HBM3") == pytest.approx(
        (dense + attention) / 2.82 / 989e12)
    assert model_flops_utilisation(QWEN3_4B, parameters, rows, 2.82, "NVIDIA H100 80GB HBM3") == pytest.approx(0.268,
                                                                                                             abs=1e-3)


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("Tesla T4", None)])
def test_the_peak_is_the_devices_dense_bf16_by_its_name_and_none_when_unknown(name, peak):
    assert peak_tflops(name) == peak
    if peak is None:
        assert model_flops_utilisation(QWEN3_4B, 4_022_468_096, [1024], 1.0, name) is None
