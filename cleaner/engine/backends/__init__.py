"""Generation and scoring backends (docs/architecture.md §6): `load_backend` picks one by name.

Imports are lazy so that importing the package never loads torch weights or sglang.
"""

from __future__ import annotations

from pathlib import Path

from cleaner.engine.backends.base import Backend

BACKEND_KINDS = ("torch", "sglang")


def load_backend(
    kind: str, model_path: str | Path, device: str = "cpu", dtype: str = "float32"
) -> Backend:
    """A ready backend: `torch` (transformers, CPU or one GPU) or `sglang` (GPU only).

    dtype is a torch dtype name (float32, bfloat16, float16); sglang maps it to its `dtype` option.
    """
    if kind == "torch":
        # torch and transformers cost CLI start-up time: loaded when a backend is asked for
        import torch  # (start-up time)

        from cleaner.engine.backends.torch_backend import TorchBackend  # (start-up time)

        return TorchBackend(model_path, device=device, dtype=getattr(torch, dtype))
    if kind == "sglang":
        from cleaner.engine.backends.sglang_backend import SGLangBackend  # optional, GPU-only extra

        return SGLangBackend(model_path, dtype=dtype)
    raise ValueError(f"backend must be one of {BACKEND_KINDS}, got {kind!r}")
