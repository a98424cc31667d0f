"""What both SGLang backends share (docs/architecture.md §6): the checkpoint they serve, and
generation and scoring built on one way to send request bodies.

The in-process engine (`sglang_engine.py`) sends a batch to `Engine.generate`, or awaits
`Engine.async_generate`; the server client (`sglang_server.py`) POSTs each body to `/generate`.
Everything else, from the request bodies to the checks on what comes back, is the same, and lives
here over `_send` (a batch, blocking) and `_send_async` (one rollout's bodies, awaited).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cleaner.engine.model.backend_scorer import BackendScorer
from cleaner.engine.model.base import (
    Generation,
    SamplingParams,
    ServedCheckpoint,
    check_generate_inputs,
    check_score_inputs,
)
from cleaner.engine.model.loading import (
    context_length_of,
    load_tokenizer_if_present,
    policy_version_of,
    vocab_size_of,
)
from cleaner.engine.model.sglang_wire import (
    computed_tokens,
    generate_body,
    generation_from_response,
    input_logprobs_from_response,
    score_body,
)


class SGLangRequests(ServedCheckpoint):
    """A policy served by SGLang: `_read_checkpoint` before the serving starts, `_serve` once it
    serves a checkpoint (and after each `adopt`), `_send` the bodies' responses in order."""

    tokenizer: object | None
    vocab_size: int | None  # the checkpoint's: every id it answers is checked against it (answers.py)
    tokens_computed: int  # over every `score` request: prompt tokens minus cached ones
    _context_length: int | None

    def _read_checkpoint(self, model_path: str | Path) -> None:
        """What the requests need from the checkpoint: its tokenizer, context length and vocab size."""
        self.tokenizer = load_tokenizer_if_present(model_path)
        self._context_length = context_length_of(model_path)  # adopt keeps the architecture
        self.vocab_size = vocab_size_of(model_path)  # for the id check of input log-probs
        self.tokens_computed = 0

    def _serve(self, model_path: str | Path) -> None:
        """Record the checkpoint now served."""
        self._model_path = Path(model_path)
        self._policy_version = policy_version_of(model_path)

    def _send(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The responses to `bodies`, in order; none for none."""
        raise NotImplementedError

    async def _send_async(self, bodies: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
        """`_send`, awaited; `session` keeps one rollout's requests on one server."""
        raise NotImplementedError

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        return None

    async def close_requests(self) -> None:
        """Close what the request methods opened on the running loop (none here)."""

    def occupies(self, device: str) -> bool:
        """No: the servers' GPUs are theirs (an engine in this process overrides it)."""
        return False

    def release_memory(self) -> None:
        """Nothing is held here (an engine in this process overrides it)."""

    def resume_memory(self) -> None:
        """See `release_memory`."""

    @property
    def context_length(self) -> int | None:
        """The checkpoint's own limit, as the engine derives it by default (an engine started with
        a smaller `--context-length` is not seen here)."""
        return self._context_length

    def scorer(self, progress: bool = False) -> BackendScorer:
        return BackendScorer(self.score, progress=progress, computed=lambda: self.tokens_computed)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        check_generate_inputs(prompts, seeds)
        bodies = [generate_body(p, params, s) for p, s in zip(prompts, seeds, strict=True)]
        return [generation_from_response(r, params.max_new_tokens, self.vocab_size) for r in self._send(bodies)]

    async def generate_async(self, prompt: Sequence[int], params: SamplingParams, seed: int,
                             session: str | None = None) -> Generation:
        check_generate_inputs([prompt], [seed])
        (response,) = await self._send_async([generate_body(prompt, params, seed)], session)
        return generation_from_response(response, params.max_new_tokens, self.vocab_size)

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        asked = [i for i, (s, p) in enumerate(zip(sequences, starts, strict=True)) if p < len(s)]
        return self._read_scores(sequences, starts, asked,
                                 self._send([score_body(sequences[i], starts[i]) for i in asked]))

    async def score_async(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                          session: str | None = None) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        asked = [i for i, (s, p) in enumerate(zip(sequences, starts, strict=True)) if p < len(s)]
        bodies = [score_body(sequences[i], starts[i]) for i in asked]
        responses = await self._send_async(bodies, session) if bodies else []
        return self._read_scores(sequences, starts, asked, responses)

    def _read_scores(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], asked: list[int],
                     responses: list[dict[str, Any]]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in sequences]
        for i, response in zip(asked, responses, strict=True):
            results[i] = input_logprobs_from_response(response, sequences[i], starts[i], self.vocab_size)
        self.tokens_computed += sum(computed_tokens(response) for response in responses)
        return results
