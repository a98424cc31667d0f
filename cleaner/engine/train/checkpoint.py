"""Atomic Hugging Face checkpoints (docs/architecture.md §7).

Design decisions:
- Checkpoints are plain `save_pretrained` directories so every backend (torch, SGLang) loads them,
  with the weights in --save-dtype (bfloat16 halves what a backend reloads each iteration; the
  float32 master weights then travel in the optimiser state, `optim.py`).
- They are written with `cleaner.outputs.atomic_directory`, as kind "checkpoint": the swap
  is atomic, and replaces only a checkpoint cleaner wrote (a warehouse, a directory holding a
  user's file or a file at `out_path` is refused and left untouched). The DeepSpeed engine, which
  writes its own weight files, uses the same function.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from cleaner.outputs import CHECKPOINT, atomic_directory

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Save


SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_pretrained_as(model: torch.nn.Module, directory: Path, save_dtype: str,
                       state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`model.save_pretrained(directory)` with its floating-point weights (or `state_dict`'s) in
    `save_dtype`, and config.json saying so, so a backend that serves the config's dtype serves it."""
    dtype = SAVE_DTYPES[save_dtype]
    weights = state_dict if state_dict is not None else model.state_dict()
    if any(t.is_floating_point() and t.dtype != dtype for t in weights.values()):
        weights = _cast_once(weights, dtype)
    model.save_pretrained(directory, state_dict=weights)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = save_dtype
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _cast_once(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The floating-point tensors in `dtype`, each storage cast once: tied weights (a shared
    embedding and lm_head) stay one tensor, which save_pretrained then writes once."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        if tensor.data_ptr() not in cast:
            cast[tensor.data_ptr()] = tensor.to(dtype)
        out[name] = cast[tensor.data_ptr()]
    return out


def save_checkpoint_atomic(
    model: torch.nn.Module,
    tokenizer: object | None,
    out_path: str | Path,
    extra_files: dict[str, str] | None = None,
    state_files: dict[str, object] | None = None,
    save_dtype: str = "float32",
    save_weights: Callable[[torch.nn.Module, Path, str], None] = save_pretrained_as,
) -> Path:
    """save_pretrained the model in `save_dtype` (+ tokenizer, + extra text files, + `torch.save`d
    objects such as the optimiser state, at relative paths) atomically at out_path. `save_weights`
    writes the weights (a LoRA model's: lora.save_with_adapters)."""
    out_path = Path(out_path).resolve()
    with atomic_directory(out_path, CHECKPOINT) as temp_dir:
        save_weights(model, temp_dir, save_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(temp_dir)
        for name, text in (extra_files or {}).items():
            (temp_dir / name).write_text(text)
        for name, state in (state_files or {}).items():
            (temp_dir / name).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, temp_dir / name)
    logger.info("saved checkpoint to %s", out_path)
    return out_path
