"""How well a train step used the GPU: model FLOPs utilisation (MFU), as verl logs `perf/mfu`.

Design decisions:
- Model FLOPs of a step over rows of T_1..T_n tokens: 6 N sum(T) (forward 2 N T, backward 4 N T, N
  the parameters, a tied embedding counted once) plus causal attention, 6 L H d sum(T_i^2) (QK^T
  and AV, forward and backward, half of each square: causal). Work the step does beyond the model's
  (gradient checkpointing's recomputation) is not model work and is not counted, as in verl and
  in PaLM's definition.
- Against the device's dense bfloat16 peak, found by its name (`PEAK_BF16_TFLOPS`, the vendors'
  dense figures, no sparsity); a device not listed gets no figure rather than a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

# Dense bfloat16 tensor-core peaks in TFLOP/s, by a part of torch.cuda.get_device_name(), most
# specific first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bfloat16 peak, or None for a device not listed."""
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device_name:
            return tflops
    return None


def step_flops(config, parameters: int, row_lengths: Sequence[int]) -> float:
    """Model FLOPs of one training step (forward and backward) over rows of these lengths."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dense = 6.0 * parameters * sum(row_lengths)
    attention = 6.0 * int(text.num_hidden_layers) * heads * head_dim * sum(t * t for t in row_lengths)
    return dense + attention


def model_flops_utilisation(config, parameters: int, row_lengths: Sequence[int], seconds: float,
                            device_name: str) -> float | None:
    """The share of the device's peak a step of `seconds` did as model work; None where unknown."""
    peak = peak_tflops(device_name)
    if peak is None or seconds <= 0:
        return None
    return step_flops(config, parameters, row_lengths) / seconds / (peak * 1e12)
