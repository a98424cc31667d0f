"""Room for a checkpoint: what one takes on disk, checked before training (docs/architecture.md §7).

A train job that would only find out after the whole iteration that its checkpoint does not fit
refuses before it trains instead. A checkpoint holds (`checkpoint.py`, `optim.py`):
- the weights in the save dtype (`save_dtype`: float32, or bfloat16 at 2 bytes a parameter);
- the optimiser state in float32: AdamW's two moments (8 bytes a parameter, `optimizer/state.pt`),
  plus the float32 master weights when the weights are saved rounded (4 more); DeepSpeed's
  partitions always hold the master weights and both moments (12);
- what else the policy directory holds (tokenizer, configs), copied as it is.
With LoRA the optimiser state is the adapters' alone, and the adapter itself (float32) is saved too.
Every parameter counts once, as the files hold it (a tied embedding is one tensor). The room asked
for (`needed_bytes`) adds a margin for what the content does not count: the serialisers' headers and
alignment and the file system's rounding to blocks (measured: 0.5-1% over the content on the tiny
policies, 63 KB on the 39M-parameter proxy; BENCHMARKS.md), so a disk with just the estimate free
refuses before training rather than failing in the save.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from cleaner.engine.train.checkpoint import SAVE_DTYPES
from cleaner.errors import free_bytes, human_bytes, mount_point


def checkpoint_bytes(n_parameters: int, save_dtype: str = "float32", engine: str = "torch",
                     other_bytes: int = 0, adapters: int | None = None) -> int:
    """About what a checkpoint of `n_parameters` takes on disk (module docstring); with LoRA's
    `adapters` (their parameters), the optimiser's state is theirs and they are saved apart."""
    weights = n_parameters * SAVE_DTYPES[save_dtype].itemsize
    if adapters is not None:  # float32 in adapter/, AdamW's two moments (and DeepSpeed's master copy)
        return weights + adapters * (4 + (12 if engine == "deepspeed" else 8)) + other_bytes
    if engine == "deepspeed":
        optimizer = n_parameters * 12
    else:
        optimizer = n_parameters * (8 if save_dtype == "float32" else 12)
    return weights + optimizer + other_bytes


SAVE_MARGIN = 1.02  # the content's share the serialisers and block rounding add, at most (twice the measured)
SAVE_OVERHEAD_BYTES = 8 * 2**20  # files' headers and last blocks, the marker, fsync's metadata


def needed_bytes(content_bytes: int) -> int:
    """The free space a checkpoint of `content_bytes` (checkpoint_bytes) asks for."""
    return math.ceil(content_bytes * SAVE_MARGIN) + SAVE_OVERHEAD_BYTES


def stored_parameters(policy: Path) -> int | None:
    """Parameters in a policy directory's weight files: safetensors headers give each tensor's
    shape; a pickled .bin is counted as float32. None for a path that is not such a directory."""
    from safetensors import safe_open  # a dependency of transformers

    policy = Path(policy)
    files = sorted(policy.glob("*.safetensors")) if policy.is_dir() else []
    if files:
        total = 0
        for file in files:
            with safe_open(file, framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    total += math.prod(weights.get_slice(name).get_shape())
        return total
    pickled = sorted(policy.glob("*.bin")) if policy.is_dir() else []
    return sum(file.stat().st_size for file in pickled) // 4 if pickled else None


def other_bytes(policy: Path) -> int:
    """Bytes of a policy directory's files that a checkpoint copies (tokenizer, configs): all but
    its weights and optimiser state."""
    policy = Path(policy)
    if not policy.is_dir():
        return 0
    return sum(entry.stat().st_size for entry in policy.iterdir()
               if entry.is_file() and entry.suffix not in (".safetensors", ".bin"))


def model_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())  # shared tensors once


def room_error(out: Path, needed: int, n_parameters: int, save_dtype: str) -> str | None:
    """The one line refusing `out` when its file system has less than `needed` bytes free; None
    when it has room."""
    free = free_bytes(out)
    if free >= needed:
        return None
    return (f"{out}: the checkpoint needs about {human_bytes(needed)} ({n_parameters:,} parameters: weights "
            f"as {save_dtype} and the float32 optimiser state), and the file system at {mount_point(out)} has "
            f"{human_bytes(free)} free; free {human_bytes(needed - free)} there or choose another --out "
            "(checked before training)")
