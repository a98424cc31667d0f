"""bench/lora_memory.py (the full step beside the LoRA step, point 7 of issue #51) at a tiny size,
and the LoRA targets of bench/gpu_check.py on probe rows made by hand."""

from __future__ import annotations

from gpu_check import LORA_SKIPPED, Sizes, lora_targets
from lora_memory import measure, table


def test_the_full_and_the_lora_step_run_side_by_side_and_the_lora_step_trains_its_adapters_alone():
    results = measure([48], 512, "proxy", True, "cpu")
    assert [r["arm"] for r in results] == ["full", "lora"] and all("error" not in r for r in results), results
    full, lora = results
    assert full["trainable"] == full["parameters"]
    assert 0 < lora["trainable"] < lora["parameters"] / 10 and lora["base_unchanged"] is True
    assert lora["parameters"] - lora["trainable"] == full["parameters"]  # the same base, adapters beside it
    row = table(results).splitlines()[2]
    assert row.startswith("| 48 | ") and f"{lora['peak_mb'] / full['peak_mb']:.2f}" in row and "| yes |" in row


def _probes(lora: dict) -> dict[str, dict]:
    return {"bf16 16384": {"cuda_peak_mb": 10_000.0}, "lora bf16 16384": lora}


def test_gpu_checks_lora_targets_hold_fail_or_say_why_they_were_not_measured():
    cuda = Sizes.of(True, None)
    skipped = lora_targets(cuda, _probes({"skipped": LORA_SKIPPED}))
    assert [(t.measured, t.holds) for t in skipped] == [(LORA_SKIPPED, None)] * 3
    small = lora_targets(cuda, _probes({"cuda_peak_mb": 5_000.0, "base_unchanged": True, "trainable": 10_092_544}))
    assert [t.holds for t in small[:2]] == [True, True] and small[0].measured.startswith("0.50x")
    big = lora_targets(cuda, _probes({"cuda_peak_mb": 7_000.0, "base_unchanged": False, "trainable": 10_092_544}))
    assert [t.holds for t in big[:2]] == [False, False]
    cpu = lora_targets(Sizes.of(False, None), {"bf16 96": {}, "lora bf16 96": {"base_unchanged": True}})
    assert [t.holds for t in cpu] == [None, True, None]
