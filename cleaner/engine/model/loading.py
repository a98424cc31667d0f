"""Loading models and tokenizers, naming their weights, and checking devices.

Shared by the backends (generation and scoring), the trainer and bootstrap, so none of them
imports another for it.

Design decisions:
- A path that exists, or that is written as a path (absolute, `./`, `../`, `~`), is a local model
  directory: if it is missing or holds no loadable model, `ModelError` says so at once, without a
  hub lookup. Anything else (`Qwen/Qwen3-4B-Instruct-2507`) is a hub id, resolved by transformers
  as usual (from its local cache; a download only where the user's machine has a network).
- `policy_version_of` = checkpoint directory name + a short content hash of the weight files, so
  two runs that load the same weights agree and a retrained checkpoint in the same directory does
  not. Only top-level files with a weight suffix are hashed: the optimiser state lives in a
  subdirectory of the checkpoint.
- `check_device` refuses a device torch cannot use here (CUDA without CUDA, a GPU index beyond
  the visible ones), so a run fails before loading anything rather than deep inside torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from cleaner.errors import CleanerError

# Files that mark a directory as carrying a tokenizer worth loading (and copying into a checkpoint).
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
FULL_HASH_LIMIT_BYTES = 256 * 2**20  # bigger weight files are hashed by sampled blocks
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 2**20


class ModelError(CleanerError):
    """A model path that does not hold a loadable model."""


class DeviceError(CleanerError):
    """A torch device that cannot be used on this machine."""


# ---------------------------------------------------------------------------- devices


def check_device(device: str | torch.device) -> torch.device:
    """The torch device, if this machine can use it; DeviceError naming it otherwise."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise DeviceError(f"device {str(device)!r}: not a torch device; expected cpu, cuda or "
                          "cuda:N") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceError(f"device {str(device)!r}: {why} (torch {torch.__version__}); use cpu")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA "
                              "device(s) are visible")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {str(device)!r}: MPS is not available here; use cpu")
    return resolved


# ---------------------------------------------------------------------------- models and tokenizers


def _is_local(path: str | Path) -> bool:
    text = str(path)
    return Path(text).exists() or text.startswith((os.sep, "./", "../", "~"))


def check_model_path(path: str | Path, tokenizer: bool = False) -> None:
    """ModelError unless `path` is a hub id or a model directory: config.json, weight files, and
    (with `tokenizer`, for the commands that build prompts) tokenizer files. Checked before a
    command writes anything, so a directory that is not a whole model leaves nothing behind."""
    if not _is_local(path):
        return  # a hub id: transformers resolves it and reports what it cannot find
    local = Path(path).expanduser()
    if local.is_file():
        raise ModelError(f"model {str(path)!r}: a file, not a directory; expected the Hugging Face model "
                         f"directory that holds it ({local.parent}?), with config.json and weights")
    if not local.is_dir():
        raise ModelError(f"model {str(path)!r}: no such directory; expected a Hugging Face model "
                         "directory (config.json and weights) or a hub id such as Qwen/Qwen3-4B")
    if not (local / "config.json").is_file():
        raise ModelError(f"model {str(path)!r}: the directory has no config.json; expected a Hugging "
                         "Face model directory (save_pretrained) with config.json and weights")
    if not weight_files(local):
        raise ModelError(f"model {str(path)!r}: the directory has no weight files "
                         f"({', '.join('*' + suffix for suffix in WEIGHT_SUFFIXES)}) beside its config.json")
    if tokenizer and not has_tokenizer(local):
        raise ModelError(f"model {str(path)!r}: the directory has no tokenizer files "
                         f"({', '.join(TOKENIZER_MARKERS)}); prompts need the model's tokenizer")


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory, sorted by name."""
    return sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def has_tokenizer(directory: Path) -> bool:
    """Whether a checkpoint directory holds tokenizer files."""
    return any((directory / name).exists() for name in TOKENIZER_MARKERS)


def load_policy(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32) -> torch.nn.Module:
    """A causal LM from a Hugging Face directory or hub id, on `device`."""
    from safetensors import SafetensorError  # with transformers: CLI start-up time
    from transformers import AutoModelForCausalLM  # transformers' import costs CLI start-up time

    check_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, SafetensorError) as error:  # a damaged weight file is bad input too
        raise ModelError(f"model {str(path)!r}: cannot load a causal LM ({error})") from error
    return model.to(check_device(device))


def load_tokenizer_if_present(path: str | Path) -> object | None:
    """The tokenizer of a checkpoint: None for a local directory without tokenizer files.

    A path that is not a local directory is taken as a hub id, whose tokenizer always exists.
    """
    local = Path(path)
    if local.is_dir() and not has_tokenizer(local):
        return None
    from transformers import AutoTokenizer  # transformers' import costs CLI start-up time

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise ModelError(f"model {str(path)!r}: cannot load its tokenizer ({error})") from error


# ---------------------------------------------------------------------------- context length

# Where Hugging Face configs keep the number of positions a model attends over, in the order tried.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(config: object) -> int | None:
    """The positions a model with this Hugging Face config attends over; None if it does not say."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_length_of(path: str | Path) -> int | None:
    """`context_length` of the checkpoint's config.json (for backends that hold no model here)."""
    from transformers import AutoConfig  # transformers' import costs CLI start-up time

    try:
        return context_length(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError) as error:
        raise ModelError(f"model {str(path)!r}: cannot read its config ({error})") from error


def vocab_size_of(path: str | Path) -> int | None:
    """The vocabulary size in a local checkpoint's config.json (a multimodal model's text config);
    None for a hub id or a config without one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


# ---------------------------------------------------------------------------- policy version


def weights_digest(model_path: str | Path) -> str:
    """12 hex digits identifying the weight files of a checkpoint directory.

    Files up to 256 MiB are hashed whole; bigger ones by their size and 64 evenly spaced 1 MiB
    blocks (an optimiser step changes every block, and hashing 8 GB per load is not cheap).
    """
    model_dir = Path(model_path)
    files = weight_files(model_dir)
    if not files:
        raise ModelError(f"model {str(model_dir)!r}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            if size <= FULL_HASH_LIMIT_BYTES:
                digest.update(handle.read())
                continue
            for block in range(SAMPLED_BLOCKS):
                handle.seek(block * (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
                digest.update(handle.read(BLOCK_BYTES))
    return digest.hexdigest()[:12]


def policy_version_of(model_path: str | Path, model: torch.nn.Module | None = None) -> str:
    """`<dir name>@<weights digest>`; a hub id (not a local dir) uses the hub commit instead."""
    if Path(model_path).is_dir():
        return f"{Path(model_path).resolve().name}@{weights_digest(model_path)}"
    commit = getattr(getattr(model, "config", None), "_commit_hash", None) or "unhashed"
    return f"{model_path}@{commit[:12]}"


