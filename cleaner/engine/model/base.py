"""The backend interface: what collect, purify and `cleaner run` use of a model, and nothing else.

A backend serves one checkpoint. It samples continuations of token-id prompts (with the behaviour
log-probabilities of the sampled tokens), scores fixed token sequences (log pi(x_t | x_<t)), hands
out a `RowScorer` for purify, and adopts the next checkpoint after training. Implementations:
`torch_backend.py` (transformers, CPU or one GPU, in this process), `sglang_engine.py` (an
in-process `sglang.Engine`) and `sglang_server.py` (running SGLang servers or a router, over HTTP)
(docs/architecture.md §6).

Design decisions:
- Token ids in, token ids out: the agent loop never re-tokenises text. The tokenizer is exposed
  only for the chat format (special-token ids, decoding).
- `model_path` is the checkpoint the backend serves, declared here, so a caller compares it
  instead of guessing at attributes. The torch backend's in-memory model is not part of the
  interface: `cleaner run` trains it in place only when the backend is a TorchBackend, and
  otherwise trains a model of its own loaded from the checkpoint (cleaner/loop/iterations.py).
- `scorer()` lets each backend choose how purify's many overlapping rows are scored: the torch
  backend forwards each radix-tree edge once on its own model (trie_scorer.py); a remote engine
  sends one request per edge and lets its own prefix cache hold the shared paths
  (backend_scorer.py).
- Two ways to ask: the batch methods (`generate`, `score`: lists in, lists out) for purify, eval's
  warm-up and tests, and the request methods (`generate_async`, `score_async`: one request,
  awaited) for the agent loop, in which every rollout awaits its own turns (docs/architecture.md
  §5). A request carries its `session` (the rollout's id), so a backend with several servers sends
  all of a rollout's requests to one of them and its prefix cache keeps the rollout's context. A
  request that fails raises for its caller alone. `event_loop` names the loop the request methods
  must be awaited on where the engine has one of its own (SGLang's in-process engine), else None.
- `release_memory` / `resume_memory`: what an engine on the trainer's GPU gives up while `cleaner
  run` trains (docs/architecture.md §9); a no-op where nothing is held beyond the model.
- Expected failures (an optional extra not installed, a server that refuses a request) are
  `BackendError`s, which the CLI prints as one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cleaner.errors import CleanerError

# Why a generation stopped.
STOP, LENGTH = "stop", "length"

SGLANG_INSTALL_HINT = "pip install 'cleaner[sglang]'"


class BackendError(CleanerError):
    """A backend that cannot be used here, or a serving engine that refused a request."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int  # per request
    stop_token_ids: tuple[int, ...]  # generation ends after emitting any of these (kept in the output)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]  # sampled tokens, including the stop token if one was hit
    logprobs: tuple[float, ...]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # STOP | LENGTH


# ---------------------------------------------------------------------------- row scorers


@dataclass
class ScorerStats:
    """Work counters, cumulative over calls (mutable on purpose: the scorer updates them)."""

    tokens_forwarded: int = 0  # real (unpadded) tokens sent through the model; an engine's: see below
    tokens_naive: int = 0  # sum of row lengths: what one full forward per row would cost
    n_prefix_groups: int = 0  # internal tree nodes whose cache was reused by >= 1 child forward
    n_forwards: int = 0  # model calls (or engine requests)
    seconds: float = 0.0
    # what a serving engine reports it computed (SGLang: prompt tokens minus its `cached_tokens`);
    # None for a scorer that forwards itself. An engine scorer's tokens_forwarded is its plan: what
    # the engine computes if its prefix cache still holds every path sent before
    tokens_computed: int | None = None


class RowScorer(Protocol):
    """Scores many token rows that share prefixes; purify's only view of a model."""

    version: str  # names the algorithm in purified rows' scorer_version
    stats: ScorerStats

    def score_rows(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        """For each sequence s and start P: [log pi(s[t] | s[:t]) for t in range(P, len(s))]."""
        ...


# ---------------------------------------------------------------------------- backends


class ServedCheckpoint:
    """Mixin: a backend's `model_path` and `policy_version`, read from what it set when it loaded
    or adopted a checkpoint (`_model_path`, `_policy_version`)."""

    _model_path: Path
    _policy_version: str

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def policy_version(self) -> str:
        return self._policy_version


class Backend(Protocol):
    """What the agent loop, purify and the run loop need from a model."""

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer; None for a directory without tokenizer files."""
        ...

    @property
    def model_path(self) -> Path:
        """The checkpoint served (a directory, or a hub id as a Path)."""
        ...

    @property
    def policy_version(self) -> str:
        """Identifies the weights (checkpoint directory name + content hash)."""
        ...

    @property
    def context_length(self) -> int | None:
        """Positions the model attends over (its config's `max_position_embeddings`); None if
        unknown. Collection checks prompts and budgets against it (docs/architecture.md §5)."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        """Sample one continuation per prompt; request i uses its own RNG seeded with seeds[i]."""
        ...

    def score(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        """For each sequence s and start P >= 1: [log pi(s[t] | s[:t]) for t in range(P, len(s))].

        Not temperature-scaled. Results must equal a naive full forward of each sequence within
        1e-4 (float32).
        """
        ...

    async def generate_async(
        self, prompt: Sequence[int], params: SamplingParams, seed: int, session: str | None = None
    ) -> Generation:
        """`generate` for one prompt, awaited; the engine batches it with whatever else is running."""
        ...

    async def score_async(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int], session: str | None = None
    ) -> list[list[float]]:
        """`score`, awaited (the IS gate's requests of one rollout)."""
        ...

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the request methods must run on; None: any."""
        ...

    async def close_requests(self) -> None:
        """Close what the request methods opened on the running loop (a connection pool), before
        the caller's loop ends."""
        ...

    def scorer(self, progress: bool = False) -> RowScorer:
        """The scorer purify uses for this backend's weights (`progress`: a progress bar)."""
        ...

    def adopt(self, model_path: str | Path) -> None:
        """Serve the checkpoint just saved at `model_path` from now on (a new policy version)."""
        ...

    def occupies(self, device: str) -> bool:
        """Does this backend hold memory on `device` that a trainer there needs while it trains
        (an engine in this process on that GPU)? Then `cleaner run` releases it around the train step."""
        ...

    def release_memory(self) -> None:
        """Give up the GPU memory generation holds (weights, KV cache) until `resume_memory`."""
        ...

    def resume_memory(self) -> None:
        """Take back what `release_memory` gave up; `adopt` then loads the weights to serve."""
        ...

    def close(self) -> None:
        """Release what the backend holds (an engine's processes and GPU memory)."""
        ...


def check_score_inputs(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    if len(sequences) != len(starts):
        raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
    for index, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(f"row {index}: start {start} outside [1, {len(seq)}]")


def check_generate_inputs(prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> None:
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
