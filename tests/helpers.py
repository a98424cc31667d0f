"""Helpers shared by test files (fixtures that use them live in conftest.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch


def tiny_qwen3(seed: int = 0, vocab_size: int = 64, num_hidden_layers: int = 2, **overrides):
    """A random-weight Qwen3ForCausalLM small enough to forward in milliseconds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=512, **overrides,
    )
    return Qwen3ForCausalLM(config)


def cli(*args: str) -> list[str]:
    """The command line that runs `cleaner ARGS` in a fresh interpreter."""
    return [sys.executable, "-m", "cleaner.cli", *args]


def wait_for(predicate, timeout_s: float, process: subprocess.Popen) -> None:
    """Poll until `predicate()`; fail if `process` ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            pytest.fail(f"process ended (rc {process.returncode}) before the kill point")
        time.sleep(0.05)
    pytest.fail("kill point not reached in time")


def tree_digest(root) -> str:
    """A hash of everything under `root`, itself included: every entry's relative path and kind,
    every file's bytes and modification time, every link's target. Equal digests: left untouched."""
    digest = hashlib.sha256()
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            if os.path.islink(path):
                digest.update(b"link:" + os.readlink(path).encode())
            elif os.path.isfile(path):
                digest.update(b"file:%d:" % os.stat(path).st_mtime_ns)
                with open(path, "rb") as handle:
                    digest.update(hashlib.sha256(handle.read()).digest())
            else:
                digest.update(b"dir")
    if os.path.isfile(root):
        with open(root, "rb") as handle:
            digest.update(b"file:%d:" % os.stat(root).st_mtime_ns + handle.read())
    return digest.hexdigest()
