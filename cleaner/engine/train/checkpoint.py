"""Atomic Hugging Face checkpoints (docs/architecture.md §7).

Design decisions:
- Checkpoints are plain `save_pretrained` directories so every backend (torch, SGLang) loads them.
- They are written with `cleaner.outputs.atomic_directory`, as kind "checkpoint": the swap
  is atomic, and replaces only a checkpoint cleaner wrote (a warehouse, a directory holding a
  user's file or a file at `out_path` is refused and left untouched). The DeepSpeed engine, which
  writes its own weight files, uses the same function.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from cleaner.outputs import CHECKPOINT, atomic_directory

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Save


def save_checkpoint_atomic(
    model: torch.nn.Module,
    tokenizer: object | None,
    out_path: str | Path,
    extra_files: dict[str, str] | None = None,
    state_files: dict[str, object] | None = None,
) -> Path:
    """save_pretrained the model (+ tokenizer, + extra text files, + `torch.save`d objects such as
    the optimiser state, at relative paths) atomically at out_path."""
    out_path = Path(out_path).resolve()
    with atomic_directory(out_path, CHECKPOINT) as temp_dir:
        model.save_pretrained(temp_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(temp_dir)
        for name, text in (extra_files or {}).items():
            (temp_dir / name).write_text(text)
        for name, state in (state_files or {}).items():
            (temp_dir / name).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, temp_dir / name)
    logger.info("saved checkpoint to %s", out_path)
    return out_path
