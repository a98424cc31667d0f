"""Generation and scoring backend interface.

A backend turns token-id prompts into sampled continuations (with the behaviour log-probabilities of
the sampled tokens) and scores fixed token sequences (log pi(x_t | x_<t)). The torch backend
(`torch_backend.py`) runs on CPU or one GPU with transformers; the SGLang backend
(`sglang_backend.py`, GPU only) implements the same two calls on `sglang.Engine` (docs/architecture.md §6).

Everything here is token ids in, token ids out: the agent loop never re-tokenises text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Why a generation stopped.
STOP, LENGTH = "stop", "length"


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


class Backend(Protocol):
    """What the agent loop and the scorer need from a model."""

    @property
    def policy_version(self) -> str:
        """Identifies the weights (e.g. checkpoint path + content hash)."""
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

        Not temperature-scaled. Implementations may reuse shared prefixes; results must equal a
        naive full forward of each sequence within 1e-4 (float32).
        """
        ...


def check_score_inputs(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    if len(sequences) != len(starts):
        raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
    for index, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(f"row {index}: start {start} outside [1, {len(seq)}]")
