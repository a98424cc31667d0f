"""SGLang's native request and response shapes, as pure functions (no sglang, no network).

Both SGLang backends use them: the in-process engine (`sglang_engine.py`) passes a batch body to
`Engine.generate`, the server client (`sglang_server.py`) POSTs single bodies to `/generate`.
Written against SGLang's source (managers/io_struct.py GenerateReqInput, the tokenizer manager's
meta_info, schedule_batch.py's finish reasons, the router's typed request), v0.5.4 and later, and
run against SGLang 0.5.23 (its engine and HTTP server on CPU) and sglang-router 0.3.2 by
`make test-sglang` (docs/architecture.md §6).

Design decisions:
- Token ids only: requests carry `input_ids`, and generated ids are read from
  `meta_info.output_token_logprobs`, a list of `[logprob, token_id, text]` with one entry per
  generated token, the matched stop token included (`output_ids` is missing from some versions'
  responses; these entries never are).
- Stop tokens: `stop_token_ids` carries ours. `ignore_eos` stays off: SGLang's token-based finish
  check returns before it looks at `stop_token_ids` when `ignore_eos` is set, so it would switch
  our stop tokens off too. The model's own EOS ids (config.json, generation_config.json) therefore
  also end a generation; such a generation keeps its EOS and reports STOP, as an answer.
- Seeds: `sampling_seed` in each request's sampling params. SGLang honours it only when the server
  or engine runs with `--enable-deterministic-inference`; otherwise sampling is not reproducible
  per seed. Seeds are reduced to [0, 2**63) (the router takes them as u64, the server as i64).
- Behaviour log-probs: SGLang reports log softmax(logits / T) of the sampled token (greedy: T = 1),
  not renormalised over the top-p nucleus; with top_p = 1 (the default) it equals the torch
  backend's number.
- Scoring asks for input log-probs with `max_new_tokens = 0` and `logprob_start_len = P - 1`:
  the entries cover positions P - 1 .. L - 1, entry 0 is a None placeholder (nothing scores the
  token at logprob_start_len). We read the LAST L - P entries and check their token ids against
  s[P:], so an off-by-one in any version is an error, never a silent shift. Input log-probs are
  never temperature-scaled. SGLang (0.5.23, scheduler_components/logprob_result_processor.py)
  reports the vocabulary's last id as 0 in `input_token_logprobs` (it clips image-hash pads with
  `x < vocab_size - 1`); the log-prob itself is that of the real token (checked against a
  transformers forward), so the check takes a 0 there when it is given the model's vocab size.
  Real checkpoints rarely use that id (their vocabularies are padded); the tiny policies do.
- The request's prefix-cache match is capped at its `logprob_start_len`; `cached_tokens` in
  meta_info says how many input tokens came from the cache (`computed_tokens`).
- Generation asks for `logprob_start_len = len(prompt) - 1`: valid in every version (older ones
  refuse >= len), and no cap on prefix reuse beyond the one SGLang always keeps (len - 1).
- One request per body, every field a scalar or a flat list: the router re-serialises requests
  into a typed struct that takes one `sampling_params` object and scalar logprob fields, so
  per-request seeds and starts cannot share a batch through it. `batch_body` builds the list form
  `Engine.generate` accepts; responses may be one object or a list (`responses_of`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cleaner.engine.model.answers import BadAnswer, checked_generation, checked_scores
from cleaner.engine.model.base import LENGTH, STOP, BackendError, Generation, SamplingParams

SEED_MODULUS = 2**63


class EngineError(BackendError, RuntimeError):
    """SGLang refused or aborted a request, or answered outside the shapes this module reads."""


# ---------------------------------------------------------------------------- requests


def sampling_params_dict(params: SamplingParams, seed: int) -> dict[str, Any]:
    """Our SamplingParams as SGLang's `sampling_params` for one request."""
    return {
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "temperature": params.temperature,  # 0 -> SGLang samples greedily (top_k = 1)
        "top_p": params.top_p,
        "sampling_seed": int(seed) % SEED_MODULUS,
    }


def generate_body(prompt: Sequence[int], params: SamplingParams, seed: int) -> dict[str, Any]:
    """The `/generate` body that samples one continuation of `prompt`."""
    return {
        "input_ids": [int(t) for t in prompt],
        "sampling_params": sampling_params_dict(params, seed),
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
        "stream": False,
    }


def score_body(sequence: Sequence[int], start: int) -> dict[str, Any]:
    """The `/generate` body that returns the input log-probs of sequence[start:] (start >= 1)."""
    return {
        "input_ids": [int(t) for t in sequence],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
        "stream": False,
    }


def batch_body(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Single bodies of the same keys as ONE batch request: every per-request field a list."""
    keys = bodies[0].keys()
    batch = {key: [body[key] for body in bodies] for key in keys if key != "stream"}
    batch["stream"] = False
    return batch


def update_weights_body(model_path: str | Path) -> dict[str, Any]:
    """The `/update_weights_from_disk` body (the fields every version accepts)."""
    return {"model_path": str(model_path)}


FLUSH_WAIT_S = 120.0  # how long a flush after new weights waits for the scheduler to go idle


def weights_in_cache_kept(message: str | None) -> bool:
    """Did a weight update load the weights but refuse to flush the radix cache?

    SGLang 0.5.23 loads the new weights, then flushes only when its scheduler is fully idle; right
    after a request returns, the scheduler may not have retired that batch yet (seen under load in
    CI), and the update fails with this message although the weights are in. A flush that waits
    for idle (`flush_cache` with a timeout) then completes the update."""
    return message is not None and "cache was not flushed" in message


# ---------------------------------------------------------------------------- responses


def responses_of(payload: Any, n_requests: int) -> list[dict[str, Any]]:
    """A `/generate` answer as one response per request: a batch answers with a list."""
    responses = payload if isinstance(payload, list) else [payload]
    for response in responses:
        if not isinstance(response, dict) or "meta_info" not in response:
            raise EngineError(f"sglang answered without meta_info: {str(response)[:200]}")
    if len(responses) != n_requests:
        raise EngineError(f"sglang answered {len(responses)} responses to {n_requests} requests")
    return responses


def generation_from_response(response: dict[str, Any], max_new_tokens: int,
                             vocab_size: int | None = None) -> Generation:
    """One response -> Generation (ids and log-probs from output_token_logprobs), checked as a
    policy's answer to a request of `max_new_tokens` (answers.py: BadAnswer if it is not one)."""
    meta = response["meta_info"]
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise EngineError(f"sglang aborted a request: {reason}")
    entries = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text or None], ...]
    if any(entry[0] is None for entry in entries):
        raise BadAnswer("sglang returned a null output log-prob (NaN or inf in the logits?)")
    try:
        generation = Generation(
            token_ids=tuple(int(entry[1]) for entry in entries),
            logprobs=tuple(float(entry[0]) for entry in entries),
            finish_reason=STOP if kind == "stop" else LENGTH,
        )
        reported = meta.get("completion_tokens")
        reported = int(reported) if reported is not None else None
    except (TypeError, ValueError, IndexError) as error:
        raise BadAnswer(f"sglang's output_token_logprobs cannot be read: {error}") from error
    return checked_generation(generation, max_new_tokens, vocab_size, reported)


def input_logprobs_from_response(response: dict[str, Any], sequence: Sequence[int], start: int,
                                 vocab_size: int | None = None) -> list[float]:
    """The log-probs of sequence[start:] from `input_token_logprobs` (checked against the ids;
    `vocab_size`, the model's, lets its last id come back as 0: see the module's notes)."""
    wanted = len(sequence) - start
    if wanted == 0:
        return []
    entries = (response["meta_info"].get("input_token_logprobs") or [])[-wanted:]
    try:
        ids = [int(entry[1]) for entry in entries]
        values = [None if entry[0] is None else float(entry[0]) for entry in entries]
    except (TypeError, ValueError, IndexError) as error:
        raise BadAnswer(f"sglang's input_token_logprobs cannot be read: {error}") from error
    expected = [int(t) for t in sequence[start:]]
    if vocab_size is not None:
        expected = [0 if t == vocab_size - 1 else t for t in expected]
    if ids != expected or None in values:
        raise BadAnswer(
            f"sglang input_token_logprobs do not line up with the sequence from position {start}"
        )
    return checked_scores(values, wanted)


def check_answer(body: dict[str, Any], response: dict[str, Any], vocab_size: int | None) -> None:
    """BadAnswer unless `response` is a policy's answer to the single request `body` (a score
    request asks for no new token)."""
    ids, params = body["input_ids"], body["sampling_params"]
    if params["max_new_tokens"] == 0:
        input_logprobs_from_response(response, ids, body["logprob_start_len"] + 1, vocab_size)
    else:
        generation_from_response(response, params["max_new_tokens"], vocab_size)


def computed_tokens(response: dict[str, Any]) -> int:
    """The input tokens the engine computed for one request: its prompt minus the prefix it served
    from its radix cache (`cached_tokens`)."""
    meta = response["meta_info"]
    return int(meta["prompt_tokens"]) - int(meta.get("cached_tokens") or 0)


def error_message(payload: Any) -> str:
    """The message of an SGLang error body: {"error": {"message": ...}} or {"error": "..."}."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("message", payload.get("detail")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)
    return str(payload)[:500]


def worker_urls(payload: Any) -> list[str] | None:
    """Worker URLs from a router's worker list: the gateway's `GET /workers`
    ({"workers": [{"url": ...}, ...], "total": N}) or the older router's `GET /list_workers`
    ({"urls": [...]}); None when `payload` is no worker list (the URL is not a router)."""
    if isinstance(payload, dict) and isinstance(payload.get("workers"), list):
        return [str(worker["url"]).rstrip("/") for worker in payload["workers"]
                if isinstance(worker, dict) and "url" in worker]
    if isinstance(payload, dict) and isinstance(payload.get("urls"), list):
        return [str(url).rstrip("/") for url in payload["urls"]]
    return None


def served_model(payload: Any) -> str | None:
    """The checkpoint a server reports in `GET /get_model_info` (normalised), or None."""
    if isinstance(payload, dict) and isinstance(payload.get("model_path"), str):
        return os.path.normpath(payload["model_path"])
    return None
