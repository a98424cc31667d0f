"""How well a train step used the GPU: model FLOPs utilisation (MFU), as verl logs `perf/mfu/actor`
(`verl/utils/flops_counter.py`, v0.7.0: `FlopsCounter` over `get_device_flops`).

Design decisions, verl's unless said:
- Model FLOPs of a step over rows of T_1..T_n tokens (prompt and response, every token the model
  reads), for the dense decoder families verl counts with its Qwen2 formula (Qwen2, Qwen2.5, Qwen3,
  Llama, Mistral and their text configs): 6 N_dense sum(T) + 12 L H d sum(T_i^2), where N_dense =
  L (3 h i + h (H d + 2 K d + H d)) + 2 V h (the MLP's three matrices, the attention's four
  projections, and BOTH embedding matrices, tied or not: norms and biases are not counted), and
  the attention term counts QK^T and AV forward and backward over the full square (no causal half).
  So the figure is comparable with verl's, not with a 6 N T count. Work beyond the model's
  (gradient checkpointing's recomputation) is not counted.
- Against the device's peak as verl's table gives it (`PEAK_TFLOPS`, dense bfloat16, matched by
  the first key in reverse-sorted order found in the device's name: an H100 PCIe reads as 989).
- Departure: where verl logs 0 (a family it does not count, a device not in its table: infinite
  peak), the figure here is None (null in train_steps.mfu): no number rather than a wrong one. The
  step's figure is its mini batch's over its own seconds; verl's is the whole update's.
"""

from __future__ import annotations

from collections.abc import Sequence

# verl's _DEVICE_FLOPS in TFLOP/s (dense bfloat16), GPUs only.
PEAK_TFLOPS = {
    "GB200": 2500.0, "B200": 2250.0, "MI300X": 1336.0, "H100": 989.0, "H800": 989.0, "H200": 989.0,
    "A100": 312.0, "A800": 312.0, "L40S": 362.05, "L40": 181.05, "A40": 149.7, "L20": 119.5, "H20": 148.0,
    "910B": 354.0, "Ascend910": 354.0, "RTX 3070 Ti": 21.75,
}
# The model types verl's FlopsCounter estimates with its Qwen2 (dense decoder) formula.
DENSE_FAMILIES = frozenset({"qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "qwen3", "qwen3_vl", "minicpmv", "minicpmo",
                            "mistral", "seed_oss", "glm4v"})


def peak_tflops(device_name: str) -> float | None:
    """The device's peak as verl's table gives it, or None for a device not listed."""
    for part, tflops in sorted(PEAK_TFLOPS.items(), reverse=True):
        if part in device_name:
            return tflops
    return None


def step_flops(config, row_lengths: Sequence[int]) -> float | None:
    """Model FLOPs of one training step (forward and backward) over rows of these lengths, as
    verl's FlopsCounter counts them; None for a model family it does not count this way."""
    text = getattr(config, "text_config", None) or config  # as FlopsCounter reads a multimodal config
    if getattr(text, "model_type", None) not in DENSE_FAMILIES:
        return None
    hidden, heads, layers = int(text.hidden_size), int(text.num_attention_heads), int(text.num_hidden_layers)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_size = int(text.num_key_value_heads) * head_dim
    mlp = 3 * hidden * int(text.intermediate_size)
    attention_linear = hidden * (2 * heads * head_dim + 2 * kv_size)  # q, o; k, v
    dense = (mlp + attention_linear) * layers + 2 * int(text.vocab_size) * hidden
    attention = 12 * sum(t * t for t in row_lengths) * head_dim * heads * layers
    return 6.0 * dense * sum(row_lengths) + attention


def model_flops_utilisation(config, row_lengths: Sequence[int], seconds: float, device_name: str) -> float | None:
    """The share of the device's peak a step of `seconds` did as model work; None where unknown."""
    peak = peak_tflops(device_name)
    flops = step_flops(config, row_lengths)
    if peak is None or flops is None or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12)
