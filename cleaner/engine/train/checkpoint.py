"""Atomic Hugging Face checkpoints (docs/architecture.md §7).

Design decisions:
- Checkpoints are plain `save_pretrained` directories so every backend (torch, SGLang) loads them.
- Atomic replace: everything is written into a temporary directory in the SAME parent (so the
  final rename never crosses a file system), every file and the directory are fsynced, then the
  temporary directory is renamed onto `out_path`. An existing `out_path` is first renamed aside,
  the new one swapped in, and only then the old one deleted. At no moment does `out_path` name a
  half-written checkpoint: it is the old complete one, absent (a crash between the two renames;
  the old one is still in `.<name>.old-*` beside it), or the new complete one.
- On any failure while writing, the temporary directory is removed and the exception re-raised.
- `atomic_directory` is the reusable core, so the DeepSpeed engine (which writes its own weight
  files) gets the same guarantee.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Atomic directory


def _fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(directory) / name)
        _fsync_path(Path(directory))


def _swap_into_place(new_dir: Path, out_path: Path) -> None:
    """Rename new_dir onto out_path; an existing out_path is moved aside first, then deleted."""
    aside = None
    if out_path.exists():
        aside = out_path.parent / f".{out_path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_path, aside)
    try:
        os.rename(new_dir, out_path)
    except OSError:
        if aside is not None:
            os.rename(aside, out_path)  # put the previous checkpoint back
        raise
    _fsync_path(out_path.parent)
    if aside is not None:
        shutil.rmtree(aside)


@contextmanager
def atomic_directory(out_path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on clean exit it atomically becomes `out_path`."""
    out_path = Path(out_path).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent))
    try:
        yield temp_dir
        _fsync_tree(temp_dir)
        _swap_into_place(temp_dir, out_path)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


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
    with atomic_directory(out_path) as temp_dir:
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
