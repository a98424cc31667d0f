"""Configuration of the Python tool's sandbox (docs/architecture.md §8).

Design decisions:
- The sandbox is a leaf tool: this module imports nothing from `cleaner.engine`, so the package,
  and the worker processes that rebuild the config from `to_json()`, stand on their own.
- `CollectConfig.sandbox` nests this dataclass, so its field names and defaults are part of every
  collect config's JSON and `config_id`: renaming a field or changing a default changes those ids.
- As every config of the project: frozen, each field's help in its metadata (its flag's help),
  invariants checked in `__post_init__` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass

BACKENDS = ("local", "docker")
MAX_SECONDS = 86_400.0  # the longest timeout: a day (the engine's configs take the same)


def _setting(default: object, help: str) -> dataclasses.Field:
    """A field with its flag's help, read as cleaner/config/settings.py's `setting` is (every field
    of this config counts toward a collect config's id)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class SandboxConfig:
    backend: str = _setting("local", help="local (worker processes) | docker")
    workers: int = _setting(2, help="warm worker processes in the pool")
    timeout_s: float = _setting(4.0, help="wall-clock limit per tool call (the paper's value)")
    cpu_time_s: int = _setting(5, help="RLIMIT_CPU per execution")
    memory_mb: int = _setting(1024, help="RLIMIT_AS per execution")
    max_processes: int = _setting(32, help="RLIMIT_NPROC of the unprivileged sandbox user")
    max_file_size_mb: int = _setting(16, help="RLIMIT_FSIZE: largest file an execution writes")
    max_open_files: int = _setting(64, help="RLIMIT_NOFILE: open files per execution")
    max_output_chars: int = _setting(2048, help="stdout/stderr kept per stream; the rest is cut with a marker")
    infra_retries: int = _setting(2, help="transparent retries of an execution lost to an infrastructure fault")
    docker_image: str = _setting("python:3.11-slim", help="image for the docker backend")
    preload_scientific: bool = _setting(True, help="warm workers also import numpy+sympy: fast `import sympy`, costlier "
        "fork")

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):  # numbers finite, durations within a day (as the engine's configs)
            value = getattr(self, item.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                _check(math.isfinite(value), f"{item.name} must be a finite number, got {value}")
                _check(not item.name.endswith("_s") or 0 < value <= MAX_SECONDS,
                       f"{item.name} must be in (0, {MAX_SECONDS:,.0f}] seconds, got {value}")
        _check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        _check(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        _check(self.cpu_time_s >= 1, f"cpu_time_s must be >= 1, got {self.cpu_time_s}")
        _check(self.memory_mb >= 64, f"memory_mb must be >= 64, got {self.memory_mb}")
        _check(self.max_processes >= 1, f"max_processes must be >= 1, got {self.max_processes}")
        _check(self.max_file_size_mb >= 1, f"max_file_size_mb must be >= 1, got {self.max_file_size_mb}")
        _check(self.max_open_files >= 16, f"max_open_files must be >= 16, got {self.max_open_files}")
        _check(self.max_output_chars >= 64, f"max_output_chars must be >= 64, got {self.max_output_chars}")
        _check(self.infra_retries >= 0, f"infra_retries must be >= 0, got {self.infra_retries}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The resolved config; the worker process is started with it."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    @functools.cached_property  # works on frozen dataclasses: it writes __dict__ directly
    def config_id(self) -> str:
        """Stable 12-hex-digit hash of every parameter (the same scheme as the engine's configs)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]
