"""Generation and scoring backends (docs/architecture.md §6): `load_backend` picks one by name.

- `torch`: transformers in this process, on CPU or one GPU (torch_backend.py).
- `sglang` with a URL: running SGLang servers or a router, over HTTP (sglang_server.py); needs
  nothing installed here beyond cleaner.
- `sglang` without a URL: an in-process `sglang.Engine` on this node's GPUs or its CPU
  (sglang_engine.py); needs the `sglang` extra (on CPU, `make sglang-cpu`).

Imports are lazy so that importing the package never loads torch weights or sglang.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

from cleaner.engine.model.base import SGLANG_INSTALL_HINT, Backend, BackendError

BACKEND_KINDS = ("torch", "sglang")


def require_backend(kind: str, sglang_url: str | None = None) -> None:
    """BackendError now, before anything is written, if `kind` cannot run here or is misconfigured."""
    if kind not in BACKEND_KINDS:
        raise BackendError(f"backend must be one of {BACKEND_KINDS}, got {kind!r}")
    if sglang_url is not None and kind != "sglang":
        raise BackendError(f"--sglang-url {sglang_url} needs --backend sglang (got {kind!r})")
    if kind == "sglang" and sglang_url is None and importlib.util.find_spec("sglang") is None:
        raise BackendError("the sglang backend needs SGLang, which is not installed here; install it "
                           f"with: {SGLANG_INSTALL_HINT} (or pass --sglang-url for a running server)")


def load_backend(kind: str, model_path: str | Path, device: str = "cpu", dtype: str | None = None,
                 sglang_url: str | None = None, seed: int = 0, *, deterministic: bool = True,
                 mem_fraction: float | None = None, request_timeout_s: float | None = None) -> Backend:
    """A ready backend serving `model_path`.

    dtype is a torch dtype name (float32, bfloat16, float16); None means float32 for torch and for
    an SGLang engine on CPU, and the checkpoint's own dtype for one on a GPU. `device` is the torch
    backend's device or the SGLang engine's (cpu, or its first GPU); a server ignores it. `seed` is
    an SGLang engine's random seed (what makes its sampling reproducible where per-request seeds
    are not honoured); the other backends take one seed per request instead. `deterministic` and
    `mem_fraction` are an SGLang engine's on a GPU (sglang_engine.py); the others ignore them.
    `request_timeout_s` is the servers' per-request limit (None: derived from each request's
    tokens; sglang_server.py).
    """
    require_backend(kind, sglang_url)
    if kind == "torch":
        # torch and transformers cost CLI start-up time: loaded when a backend is asked for
        import torch  # (start-up time)

        from cleaner.engine.model.torch_backend import TorchBackend  # (start-up time)

        return TorchBackend(model_path, device=device, dtype=getattr(torch, dtype or "float32"))
    if sglang_url is not None:
        from cleaner.engine.model.sglang_server import SGLangServerBackend  # (start-up time)

        return SGLangServerBackend(sglang_url, model_path, request_timeout_s=request_timeout_s)
    from cleaner.engine.model.sglang_engine import SGLangBackend  # (start-up time)

    return SGLangBackend(model_path, device=device, dtype=dtype, seed=seed, deterministic=deterministic,
                         mem_fraction=mem_fraction)


@contextlib.contextmanager
def serving_backend(backend: Backend | None, load: Callable[[], Backend]) -> Iterator[Backend]:
    """The caller's backend, or one loaded for this job and closed when it ends."""
    if backend is not None:
        yield backend
        return
    loaded = load()
    try:
        yield loaded
    finally:
        loaded.close()
