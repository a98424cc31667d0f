"""Generation and naive scoring with a transformers causal LM, on CPU or one GPU.

Design decisions:
- Generation is continuous batching (torch_batching.py): left padding, a 2-D attention mask and
  position ids that start at 0 on each row's first real token; rows that end leave the batch and
  its cache at once. `generate` (a list of prompts) runs one batch to its end in the caller's
  thread; `generate_async` (one prompt, the agent loop's) joins the batch a decoding thread keeps
  running, at the next step, so the rollouts that wait for a turn always decode together however
  their tools and turns interleave.
- Each row samples with its own CPU `torch.Generator` seeded with its seed: the row draws one
  uniform per step and the token is found by inverse CDF on the device. A row's random stream
  therefore does not depend on which other prompts share the batch, and the RNG never leaves CPU.
- The behaviour log-prob of a sampled token is its log-prob under the distribution actually
  sampled from: logits / temperature, then top-p truncation and renormalisation. At temperature
  0 (greedy) the sampling distribution is a point mass, so we report the plain log-softmax of the
  raw logits instead (the informative number, and what a T=1 scorer would give).
- `score` is the NAIVE reference: one full forward per sequence (right-padded batches). The
  prefix-reusing scorer lives in `trie_scorer.py` and is tested against this. `score_async` runs it
  on the decoding thread between two steps, so two forwards never share the model at once.
- `policy_version` = checkpoint dir name + short content hash of the weight files
  (`cleaner.engine.model.loading.policy_version_of`).
- The in-memory model is this backend's own, beyond the Backend protocol: purify's scorer
  (`scorer()`, the prefix-trie scorer) runs on it, and `cleaner run` trains it in place
  (`train_in_place()`), so no phase reloads weights. `adopt(path)` after such training only takes
  the saved checkpoint's name and version; after anything else it loads the weights from `path`.
  The decoding thread starts a new batch on whatever `self.model` is when its batch is empty, so
  weights change only between collections (the run loop trains and adopts while nothing decodes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cleaner.engine.model.answers import checked_generation, checked_score_rows
from cleaner.engine.model.base import (
    Generation,
    SamplingParams,
    ServedCheckpoint,
    check_generate_inputs,
    check_score_inputs,
)
from cleaner.engine.model.kv import causal_forward, target_logprobs
from cleaner.engine.model.loading import (
    check_device,
    context_length,
    load_policy,
    load_tokenizer_if_present,
    policy_version_of,
)
from cleaner.engine.model.torch_batching import (
    DEFAULT_MAX_ROWS,
    DEFAULT_MAX_TOKENS,
    DecodeBatch,
    DecodeRequest,
    DecodeServer,
    run_to_end,
)
from cleaner.engine.model.trie_scorer import PrefixTrieScorer

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- backend


class TorchBackend(ServedCheckpoint):
    """The Backend protocol (base.py) on a transformers causal LM."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = 8192,  # naive score: rows x padded length per forward
        max_running_rows: int = DEFAULT_MAX_ROWS,  # generate_async: rows decoding at once
        max_running_tokens: int = DEFAULT_MAX_TOKENS,  # generate_async: rows x padded cache width
    ) -> None:
        self.device = check_device(device)
        self.dtype = dtype
        self.max_batch_tokens = max_batch_tokens
        self.model: torch.nn.Module
        self.tokenizer = None
        self._model_path = Path(model_path)
        self._policy_version = ""
        self._trained_in_place = False  # train_in_place() handed the model out since the last adopt
        self.reload(model_path)
        self._server = DecodeServer(self._new_batch, max_running_rows, max_running_tokens)

    @property
    def context_length(self) -> int | None:
        return context_length(self.model.config)

    @property
    def vocab_size(self) -> int | None:
        """Rows of the model's embedding: the ids a forward can take (answers.py)."""
        size = getattr(self.model.config, "vocab_size", None)
        return int(size) if size is not None else None

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def reload(self, model_path: str | Path) -> None:
        """Load (or replace) the weights and tokenizer from a checkpoint directory."""
        self.model = load_policy(model_path, self.device, self.dtype).eval()
        self._model_path = Path(model_path)
        self.tokenizer = load_tokenizer_if_present(model_path)
        self._policy_version = policy_version_of(model_path, self.model)
        self._trained_in_place = False
        log.info("loaded %s on %s as %s", model_path, self.device, self._policy_version)

    def train_in_place(self) -> torch.nn.Module:
        """The in-memory model, for a trainer that updates it and saves it; the next `adopt` takes
        the saved checkpoint without reloading it."""
        self._trained_in_place = True
        return self.model

    def adopt(self, model_path: str | Path) -> None:
        """Serve the checkpoint just saved at `model_path`.

        After `train_in_place()` the in-memory model is what was saved there, so only the path and
        the policy version (hash of the saved weights) move on and the model goes back to eval
        mode; otherwise the weights are loaded from `model_path`.
        """
        if not self._trained_in_place:
            self.reload(model_path)
            return
        self.model.eval()
        self._model_path = Path(model_path)
        self._policy_version = policy_version_of(model_path, self.model)
        self._trained_in_place = False

    def scorer(self, progress: bool = False, memory_bytes: int | None = None) -> PrefixTrieScorer:
        """The prefix-trie scorer on this backend's model (the model must use sdpa or eager);
        `memory_bytes` caps what its forwards' caches take on a GPU."""
        return PrefixTrieScorer(self.model, device=self.device, progress=progress, memory_bytes=memory_bytes)

    @property
    def event_loop(self) -> None:
        """Any event loop will do: results come back from the decoding thread thread-safely."""
        return None

    @property
    def decode_stats(self) -> tuple[int, int]:
        """(decode steps, rows over those steps) of the decoding thread: the mean batch it ran."""
        return self._server.steps, self._server.rows_stepped

    async def close_requests(self) -> None:
        """Nothing is opened per event loop."""

    def occupies(self, device: str) -> bool:
        """No: the model it holds is the one `cleaner run` trains (in place)."""
        return False

    def release_memory(self) -> None:
        """Nothing held beyond the model, which `cleaner run` trains in place."""

    def resume_memory(self) -> None:
        """See `release_memory`."""

    def close(self) -> None:
        """Stop the decoding thread; the model is freed with the backend."""
        self._server.close()

    def set_weights(self, state_dict: dict[str, torch.Tensor], policy_version: str) -> None:
        """Copy new weights in place (same architecture); the caller names the new version.

        A tied output embedding may be left out of `state_dict`; any other missing or unknown
        key is an error.
        """
        result = self.model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = set(result.missing_keys) - tied
        if missing or result.unexpected_keys:
            raise ValueError(f"set_weights: missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
        self._policy_version = policy_version

    # ------------------------------------------------------------------------ generate

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        """Sample one continuation per prompt, all prompts admitted to one batch at once."""
        check_generate_inputs(prompts, seeds)
        results: list[Generation | BaseException | None] = [None] * len(prompts)

        def keep(index: int) -> Callable[[Generation | BaseException], None]:
            return lambda result: results.__setitem__(index, result)

        requests = [DecodeRequest(tuple(int(t) for t in prompt), params, int(seed), keep(index))
                    for index, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))]
        run_to_end(self._new_batch(), requests)
        return [result if isinstance(result, BaseException)  # run_to_end ends every request
                else checked_generation(result, params.max_new_tokens, self.vocab_size) for result in results]

    async def generate_async(self, prompt: Sequence[int], params: SamplingParams, seed: int,
                             session: str | None = None) -> Generation:
        """One continuation, sampled in the running batch of the decoding thread (torch_batching.py)."""
        check_generate_inputs([prompt], [seed])
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result: Generation | BaseException) -> None:
            if not loop.is_closed():  # a collection that was stopped closed its loop: nobody waits
                loop.call_soon_threadsafe(_settle, future, result)

        self._server.submit(DecodeRequest(tuple(int(t) for t in prompt), params, int(seed), done,
                                          cancelled=future.cancelled))
        return checked_generation(await future, params.max_new_tokens, self.vocab_size)

    async def score_async(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                          session: str | None = None) -> list[list[float]]:
        """`score`, run on the decoding thread between two of its steps."""
        check_score_inputs(sequences, starts)
        scores = await asyncio.wrap_future(self._server.call(lambda: self.score(sequences, starts)))
        return checked_score_rows(scores, sequences, starts)

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(self.model, self.device, self.pad_id)

    # ------------------------------------------------------------------------ score (naive)

    @torch.inference_mode()
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """[log pi(s[t] | s[:t]) for t in range(P, len(s))] by one full forward per sequence."""
        check_score_inputs(sequences, starts)
        results: list[list[float]] = [[] for _ in sequences]
        for batch in token_budget_batches([len(s) for s in sequences], self.max_batch_tokens):
            self._score_batch([sequences[i] for i in batch], batch, starts, results)
        return results

    def _score_batch(self, rows, indices, starts, results) -> None:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, seq in enumerate(rows):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = torch.arange(width, device=self.device).expand(len(rows), -1)
        logits = causal_forward(self.model, input_ids, attention_mask, position_ids).logits
        logprobs = target_logprobs(logits[:, :-1], input_ids[:, 1:]).cpu()  # (B, T-1)
        for row, (seq, index) in enumerate(zip(rows, indices, strict=True)):
            results[index] = logprobs[row, starts[index] - 1 : len(seq) - 1].tolist()


def _settle(future: asyncio.Future, result: Generation | BaseException) -> None:
    """Hand a decoding thread's result to its waiter (on the waiter's loop), unless it gave up."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


# ---------------------------------------------------------------------------- helpers


def token_budget_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Row indices, longest first, grouped so rows x longest length <= budget (>= 1 row each)."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches
