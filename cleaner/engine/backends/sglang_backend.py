"""The Backend protocol on `sglang.Engine` (GPU only). UNVERIFIED: written against SGLang's source
(python/sglang/srt/entrypoints/engine.py, sampling/sampling_params.py, managers/tokenizer_manager.py)
without a GPU to run it on; its tests are marked `gpu`.

Design decisions:
- Token ids only: the engine starts with `skip_tokenizer_init=True`, requests carry `input_ids`,
  and the generated ids are read from `meta_info["output_token_logprobs"]`, a list of
  `(logprob, token_id, text)` with one entry per generated token, the stop token included.
- Our stop criterion is `stop_token_ids` and nothing else (as in the torch backend), so requests
  set `ignore_eos=True`: the model's own EOS only stops generation when the caller lists it.
- Seeds: each request carries `sampling_seed=seeds[i]`. SGLang honours it when the engine runs
  with deterministic inference (`enable_deterministic_inference=True`); otherwise sampling is not
  reproducible per seed. We do not force that flag: it costs throughput.
- Behaviour log-probs: SGLang reports output log-probs after temperature scaling (unless the
  environment sets SGLANG_RETURN_ORIGINAL_LOGPROB) but, as far as we can read, before top-p
  renormalisation. With top_p = 1 (the project default) this equals the torch backend's number.
- `score` is one `generate` call with `max_new_tokens=0`, `return_logprob=True` and
  `logprob_start_len = P - 1`. SGLang caps its radix-cache prefix match at logprob_start_len, so the
  tokens before it come from RadixAttention's cache and only the rest is recomputed; requests are
  sent sorted so that rows sharing a prefix are adjacent (the scorer's `BackendScorer` can warm the
  shared prefixes first). We read the LAST len(s) - P entries of `input_token_logprobs` and check
  their token ids against s[P:], so the result does not depend on whether entry 0 is the None
  placeholder of position P - 1. Input log-probs are not temperature-scaled.
- New weights: `update_weights_from_disk(path)` then `flush_cache()`, so no KV computed with the
  old weights is ever reused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cleaner.engine.backends.base import (
    LENGTH,
    STOP,
    Generation,
    SamplingParams,
    check_score_inputs,
)
from cleaner.engine.models import policy_version_of

log = logging.getLogger(__name__)


class SGLangBackend:
    """Generation and scoring on an in-process `sglang.Engine`."""

    def __init__(self, model_path: str | Path, **engine_kwargs: Any) -> None:
        import sglang  # lazy: GPU-only dependency

        engine_kwargs.setdefault("skip_tokenizer_init", True)
        self.model_path = Path(model_path)
        self.engine = sglang.Engine(model_path=str(model_path), **engine_kwargs)
        self.tokenizer = None
        self._policy_version = policy_version_of(model_path)

    @property
    def policy_version(self) -> str:
        return self._policy_version

    def reload(self, model_path: str | Path) -> None:
        """Swap in the weights of another checkpoint of the same architecture."""
        result = self.engine.update_weights_from_disk(str(model_path))
        success, message = result[0], result[1]
        if not success:
            raise RuntimeError(f"sglang could not load weights from {model_path}: {message}")
        self.engine.flush_cache()
        self.model_path = Path(model_path)
        self._policy_version = policy_version_of(model_path)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------------------ generate

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Generation]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        sampling = [sampling_params_dict(params, seed) for seed in seeds]
        outputs = self.engine.generate(
            input_ids=[list(p) for p in prompts], sampling_params=sampling, return_logprob=True
        )
        return [generation_from_output(output, params) for output in outputs]

    # ------------------------------------------------------------------------ score

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        if not sequences:
            return []
        order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))
        outputs = self.engine.generate(
            input_ids=[list(sequences[i]) for i in order],
            sampling_params=[{"max_new_tokens": 0} for _ in order],
            return_logprob=True,
            logprob_start_len=[starts[i] - 1 for i in order],
        )
        results: list[list[float]] = [[] for _ in sequences]
        for index, output in zip(order, outputs, strict=True):
            results[index] = input_logprobs_from_output(output, sequences[index], starts[index])
        return results


# ---------------------------------------------------------------------------- wire format


def sampling_params_dict(params: SamplingParams, seed: int) -> dict[str, Any]:
    """Our SamplingParams as SGLang's `sampling_params` for one request."""
    return {
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "temperature": params.temperature,  # 0 -> SGLang switches to top_k = 1 (greedy)
        "top_p": params.top_p,
        "ignore_eos": True,
        "sampling_seed": int(seed),
    }


def generation_from_output(output: dict[str, Any], params: SamplingParams) -> Generation:
    """One `Engine.generate` result -> Generation (ids and log-probs from output_token_logprobs)."""
    meta = output["meta_info"]
    entries = meta["output_token_logprobs"]  # [(logprob, token_id, text or None), ...]
    token_ids = tuple(int(entry[1]) for entry in entries)
    logprobs = tuple(float(entry[0]) for entry in entries)
    reason = meta["finish_reason"]
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise RuntimeError(f"sglang aborted a request: {reason}")
    stopped = kind == "stop" and bool(token_ids) and token_ids[-1] in params.stop_token_ids
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=STOP if stopped else LENGTH)


def input_logprobs_from_output(output: dict[str, Any], sequence: Sequence[int], start: int) -> list[float]:
    """The log-probs of sequence[start:] from `input_token_logprobs` (checked against the ids)."""
    wanted = len(sequence) - start
    if wanted == 0:
        return []
    entries = output["meta_info"]["input_token_logprobs"][-wanted:]
    ids = [int(entry[1]) for entry in entries]
    if ids != list(sequence[start:]) or any(entry[0] is None for entry in entries):
        raise RuntimeError(
            f"sglang input_token_logprobs do not line up with the sequence from position {start}"
        )
    return [float(entry[0]) for entry in entries]
