"""The Backend protocol on an in-process `sglang.Engine` (one node's GPUs). UNVERIFIED: written
against SGLang's source (entrypoints/engine.py, managers/io_struct.py) without a GPU to run it on;
its tests are the `gpu` cases of tests/engine/backends/test_contract.py.

Design decisions:
- The engine starts with `skip_tokenizer_init=True` (requests are token ids; sglang_wire.py has
  the request and response shapes); the tokenizer for the chat format is loaded here with
  transformers from the same checkpoint.
- `device` picks the first GPU (`cuda:N` -> `base_gpu_id=N`); other engine options (`tp_size`,
  `mem_fraction_static`, ...) pass through as keyword arguments.
- Deterministic inference is on by default: SGLang honours per-request seeds only with it, and
  the project's seeds and `--resume` rely on a seed giving the same rollout. It costs throughput;
  `enable_deterministic_inference=False` turns it off.
- One `Engine.generate` call per `generate` or `score`, with per-request lists: the engine batches
  them itself. Purify's scorer is `BackendScorer` over `score`: one request per radix-tree edge,
  so RadixAttention holds the shared paths (backend_scorer.py).
- New weights: `update_weights_from_disk(path)`, which waits for running requests and flushes the
  radix cache, so no KV computed with the old weights is reused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cleaner.engine.backends.backend_scorer import BackendScorer
from cleaner.engine.backends.base import (
    SGLANG_INSTALL_HINT,
    BackendError,
    Generation,
    SamplingParams,
    check_generate_inputs,
    check_score_inputs,
)
from cleaner.engine.backends.sglang_wire import (
    EngineError,
    batch_body,
    generate_body,
    generation_from_response,
    input_logprobs_from_response,
    responses_of,
    score_body,
)
from cleaner.engine.models import context_length_of, load_tokenizer_if_present, policy_version_of

log = logging.getLogger(__name__)


def import_sglang():
    """The sglang module, or a BackendError saying how to install it."""
    try:
        import sglang  # optional extra, GPU only
    except ImportError as error:
        raise BackendError(f"the sglang backend needs SGLang, which is not installed here ({error}); "
                           f"install it with: {SGLANG_INSTALL_HINT}") from error
    return sglang


def gpu_index(device: str) -> int:
    """`cuda` -> 0, `cuda:N` -> N; anything else is a BackendError (the engine needs a GPU)."""
    kind, _, index = str(device).partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise BackendError(f"device {device!r}: the sglang engine runs on a CUDA GPU; pass --device cuda "
                           "or cuda:N, or --sglang-url for a running server")
    return int(index or 0)


class SGLangBackend:
    """Generation and scoring on an in-process `sglang.Engine`."""

    def __init__(self, model_path: str | Path, device: str = "cuda", dtype: str = "auto",
                 **engine_kwargs: Any) -> None:
        sglang = import_sglang()
        engine_kwargs.setdefault("skip_tokenizer_init", True)
        engine_kwargs.setdefault("base_gpu_id", gpu_index(device))
        engine_kwargs.setdefault("enable_deterministic_inference", True)
        self._model_path = Path(model_path)
        self.tokenizer = load_tokenizer_if_present(model_path)
        self._context_length = context_length_of(model_path)  # adopt keeps the architecture
        self.engine = sglang.Engine(model_path=str(model_path), dtype=dtype, **engine_kwargs)
        self._policy_version = policy_version_of(model_path)

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def policy_version(self) -> str:
        return self._policy_version

    @property
    def context_length(self) -> int | None:
        """The checkpoint's own limit, as the engine derives it by default (an engine started with
        a smaller `--context-length` is not seen here)."""
        return self._context_length

    def adopt(self, model_path: str | Path) -> None:
        """Load the weights saved at `model_path` (same architecture) into the running engine."""
        result = self.engine.update_weights_from_disk(str(model_path))
        if not result[0]:  # (success, message, num_paused_requests)
            raise EngineError(f"sglang could not load weights from {model_path}: {result[1]}")
        self._model_path = Path(model_path)
        self._policy_version = policy_version_of(model_path)
        log.info("sglang engine now serves %s as %s", model_path, self._policy_version)

    def scorer(self, progress: bool = False) -> BackendScorer:
        return BackendScorer(self.score, progress=progress)

    def close(self) -> None:
        self.engine.shutdown()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        check_generate_inputs(prompts, seeds)
        if not prompts:
            return []
        bodies = [generate_body(p, params, s) for p, s in zip(prompts, seeds, strict=True)]
        responses = responses_of(self.engine.generate(**batch_body(bodies)), len(bodies))
        return [generation_from_response(r) for r in responses]

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        asked = [i for i, (s, p) in enumerate(zip(sequences, starts, strict=True)) if p < len(s)]
        results: list[list[float]] = [[] for _ in sequences]
        if asked:
            bodies = [score_body(sequences[i], starts[i]) for i in asked]
            responses = responses_of(self.engine.generate(**batch_body(bodies)), len(bodies))
            for i, response in zip(asked, responses, strict=True):
                results[i] = input_logprobs_from_response(response, sequences[i], starts[i])
        return results
