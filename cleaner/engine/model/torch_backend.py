"""Generation and naive scoring with a transformers causal LM, on CPU or one GPU.

Design decisions:
- `generate` batches every prompt: left padding, a 2-D attention mask and position ids that start
  at 0 on each row's first real token, one prefill, then one decode step per token with the KV
  cache. Finished rows (stop token emitted or `max_new_tokens` reached) are dropped from the batch
  and its cache, so they cost nothing afterwards.
- Each row samples with its own CPU `torch.Generator` seeded with `seeds[i]`: the row draws one
  uniform per step and the token is found by inverse CDF on the device. A row's random stream
  therefore does not depend on which other prompts share the batch, and the RNG never leaves CPU.
- The behaviour log-prob of a sampled token is its log-prob under the distribution actually
  sampled from: logits / temperature, then top-p truncation and renormalisation. At temperature
  0 (greedy) the sampling distribution is a point mass, so we report the plain log-softmax of the
  raw logits instead (the informative number, and what a T=1 scorer would give).
- `score` is the NAIVE reference: one full forward per sequence (right-padded batches). The
  prefix-reusing scorer lives in `trie_scorer.py` and is tested against this.
- `policy_version` = checkpoint dir name + short content hash of the weight files
  (`cleaner.engine.model.loading.policy_version_of`).
- The in-memory model is this backend's own, beyond the Backend protocol: purify's scorer
  (`scorer()`, the prefix-trie scorer) runs on it, and `cleaner run` trains it in place
  (`train_in_place()`), so no phase reloads weights. `adopt(path)` after such training only takes
  the saved checkpoint's name and version; after anything else it loads the weights from `path`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from cleaner.engine.model.base import (
    LENGTH,
    STOP,
    Generation,
    SamplingParams,
    check_generate_inputs,
    check_score_inputs,
)
from cleaner.engine.model.kv import causal_forward, kv_select, target_logprobs
from cleaner.engine.model.loading import (
    check_device,
    context_length,
    load_policy,
    load_tokenizer_if_present,
    policy_version_of,
)
from cleaner.engine.model.trie_scorer import PrefixTrieScorer

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- sampling


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a row is sampled from. logits (B, V) -> (B, V) float32.

    temperature 0 returns the raw log-softmax (greedy reports its token's untempered log-prob).
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if temperature > 0 and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        outside = mass_before >= top_p  # the first token is always kept
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.log_softmax(dim=-1)


def draw_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. logprobs (B, V), uniforms (B,) in [0, 1) -> token ids (B,)."""
    cdf = logprobs.exp().cumsum(dim=-1)  # (B, V)
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # (B,)
    return tokens.clamp(max=cdf.shape[-1] - 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Left-padded ids (B, T), attention mask (B, T) and position ids (B, T)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


# ---------------------------------------------------------------------------- backend


class TorchBackend:
    """The Backend protocol (base.py) on a transformers causal LM."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = 8192,  # naive score: rows x padded length per forward
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

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def policy_version(self) -> str:
        return self._policy_version

    @property
    def context_length(self) -> int | None:
        return context_length(self.model.config)

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

    def scorer(self, progress: bool = False) -> PrefixTrieScorer:
        """The prefix-trie scorer on this backend's model (the model must use sdpa or eager)."""
        return PrefixTrieScorer(self.model, device=self.device, progress=progress)

    def close(self) -> None:
        """Nothing to release: the model is freed with the backend."""

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

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        """Sample one continuation per prompt, all prompts in one left-padded batch."""
        check_generate_inputs(prompts, seeds)
        if not prompts:
            return []
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        stop_ids = set(params.stop_token_ids)
        outputs: list[list[tuple[int, float]]] = [[] for _ in prompts]
        finish = [LENGTH] * len(prompts)

        input_ids, attention_mask, position_ids = left_pad(prompts, self.pad_id, self.device)
        step = causal_forward(self.model, input_ids, attention_mask, position_ids, logits_to_keep=1)
        active = list(range(len(prompts)))  # original index of each batch row
        next_positions = position_ids[:, -1:] + 1  # (B, 1)
        for _ in range(params.max_new_tokens):
            tokens, token_logprobs = self._sample(step.logits[:, -1], params, [generators[i] for i in active])
            keep = []
            sampled = zip(tokens.tolist(), token_logprobs.tolist(), strict=True)  # one device sync
            for row, (index, token_and_logprob) in enumerate(zip(active, sampled, strict=True)):
                outputs[index].append(token_and_logprob)
                if outputs[index][-1][0] in stop_ids:
                    finish[index] = STOP
                elif len(outputs[index]) < params.max_new_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the cache
                rows = torch.tensor(keep, device=self.device)
                step_kv, tokens = kv_select(step.kv, rows), tokens[rows]
                attention_mask, next_positions = attention_mask[rows], next_positions[rows]
                active = [active[row] for row in keep]
            else:
                step_kv = step.kv
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
            step = causal_forward(
                self.model, tokens.unsqueeze(-1), attention_mask, next_positions, past=step_kv
            )
            next_positions = next_positions + 1
        return [
            Generation(tuple(t for t, _ in out), tuple(lp for _, lp in out), reason)
            for out, reason in zip(outputs, finish, strict=True)
        ]

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, V) -> sampled tokens (B,) and their behaviour log-probs (B,)."""
        logprobs = sampling_logprobs(logits, params.temperature, params.top_p)  # (B, V)
        if params.temperature == 0:
            tokens = logits.argmax(dim=-1)
        else:
            uniforms = torch.cat([torch.rand(1, generator=g) for g in generators])  # (B,)
            tokens = draw_tokens(logprobs, uniforms)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

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
