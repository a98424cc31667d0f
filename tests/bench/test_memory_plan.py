"""bench/memory_plan.py writes docs/running.md's "Will it fit" table from memory.py's estimate."""

from __future__ import annotations

from pathlib import Path

from memory_plan import lora_table, table


def test_the_docs_will_it_fit_table_is_the_estimates():
    running = (Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
    assert table(16_384) in running
    assert "| Qwen3-4B (4.02B) | fits:" in running and "| Qwen3-8B (8.19B) | does not fit:" in running


def test_a_7b_lora_run_with_its_kl_fits_one_80_gb_gpu_where_training_every_weight_does_not():
    """docs/running.md's LoRA table (`bench/memory_plan.py --lora --micro-tokens 23040`): Qwen2.5-7B,
    bfloat16, checkpointing, the KL term on, the recipes' 23,040-token micro batches, one 80 GB GPU."""
    lora = lora_table(23_040)
    row = next(line for line in lora.splitlines() if line.startswith("| Qwen2.5-7B (7.62B) |"))
    assert row.split(" | ")[1:3] == ["does not fit: 133 GB", "fits: 42 GB (20M)"]
    assert lora in (Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
