"""The Backend protocol over HTTP: running SGLang servers, or a router in front of many, on any nodes.

Run against real SGLang 0.5.23 servers on CPU and sglang-router 0.3.2 in front of two of them, on
127.0.0.1 (`make test-sglang`: the contract suite on a server, `cleaner run` through the router).

Design decisions:
- Standard library only (urllib, json, a thread pool): a client machine needs nothing installed
  beyond cleaner itself, and no sglang.
- Every request is a single `/generate` body, sent concurrently (`max_concurrency` in flight).
  A router takes per-request seeds and starts only one request at a time (sglang_wire.py) and
  spreads single requests over its workers; a plain server batches concurrent requests itself.
- Weights: `POST /update_weights_from_disk` with the checkpoint path, which every server must see
  at the same path (a shared filesystem). A router has no such endpoint, so the workers are found
  once, at start: `GET /workers` (the model gateway, sglang-router >= 0.2) or `GET /list_workers`
  (the older router); if neither answers with a worker list, the URL is a server itself. A router
  that lists no worker is an error: it registers the workers it was started with a moment after it
  answers its health check. Each worker is updated in turn; the update waits for its running
  requests and flushes its radix cache.
- At start every worker is asked which checkpoint it serves (`GET /model_info`, `/get_model_info`
  before SGLang 0.5.10) and is moved to ours if it differs, so collect, purify and run always
  sample the policy they record.
- The tokenizer (for the chat format) and the policy version (a hash of the weight files) come
  from the checkpoint on this machine.
- `tokens_computed` counts what the servers say they computed for scoring requests (prompt
  tokens minus `cached_tokens`), for the scorer's stats.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cleaner.engine.model.sglang_common import SGLangRequests
from cleaner.engine.model.sglang_wire import (
    FLUSH_WAIT_S,
    EngineError,
    error_message,
    responses_of,
    served_model,
    update_weights_body,
    weights_in_cache_kept,
    worker_urls,
)

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64  # requests in flight; enough to keep a few servers' batches full


# ---------------------------------------------------------------------------- HTTP


def http_json(url: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, Any]:
    """GET (body None) or POST JSON; (status, parsed body or text). Unreachable -> EngineError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    except (urllib.error.URLError, OSError) as error:
        raise EngineError(f"cannot reach sglang at {url}: {error}") from error
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def post_ok(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    """POST and return the parsed answer; a non-2xx status is an EngineError with SGLang's message."""
    status, payload = http_json(url, body, timeout_s)
    if not 200 <= status < 300:
        raise EngineError(f"POST {url}: HTTP {status}: {error_message(payload)}")
    return payload


def discover_workers(url: str, timeout_s: float) -> list[str]:
    """The servers behind `url`: a router's workers, or [url] when `url` is a server itself."""
    for route in ("/workers", "/list_workers"):
        status, payload = http_json(url + route, None, timeout_s)
        found = worker_urls(payload) if status == 200 else None
        if found == []:
            raise EngineError(f"the router at {url} lists no workers (GET {route}); start its servers, "
                              "or wait until it has registered them")
        if found:
            return found
    return [url]


def served_checkpoint(worker: str, timeout_s: float) -> str | None:
    """The checkpoint a server says it serves, or None if it does not say."""
    for route in ("/model_info", "/get_model_info"):
        status, info = http_json(worker + route, None, timeout_s)
        if status == 200:
            return served_model(info)
    return None


# ---------------------------------------------------------------------------- backend


class SGLangServerBackend(SGLangRequests):
    """Generation and scoring through SGLang's native `/generate` on running servers."""

    def __init__(self, url: str, model_path: str | Path, *, max_concurrency: int = DEFAULT_CONCURRENCY,
                 timeout_s: float = 3600.0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self._read_checkpoint(model_path)
        self.workers = discover_workers(self.url, timeout_s)
        log.info("sglang at %s: %d server(s) %s", self.url, len(self.workers), self.workers)
        self._serve(model_path)
        for worker in self.workers:
            if served_checkpoint(worker, timeout_s) != os.path.normpath(str(model_path)):
                self._update(worker, model_path)

    def adopt(self, model_path: str | Path) -> None:
        """Every server loads the checkpoint saved at `model_path` (same architecture)."""
        for worker in self.workers:
            self._update(worker, model_path)
        self._serve(model_path)

    def _update(self, worker: str, model_path: str | Path) -> None:
        status, answer = http_json(worker + "/update_weights_from_disk", update_weights_body(model_path),
                                   self.timeout_s)
        message = error_message(answer)
        if not 200 <= status < 300 and weights_in_cache_kept(message):  # weights in, flush when idle
            status, answer = http_json(f"{worker}/flush_cache?timeout={FLUSH_WAIT_S:g}", {},
                                       self.timeout_s + FLUSH_WAIT_S)
            message = error_message(answer)
        if not 200 <= status < 300 or isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"{worker} could not load weights from {model_path}: HTTP {status}: {message}")
        log.info("%s now serves %s", worker, model_path)

    def close(self) -> None:
        """Nothing to release: the servers keep running."""

    # ------------------------------------------------------------------------ requests

    def _send(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST every body to `/generate`, `max_concurrency` at a time; responses in body order."""
        def one(body: dict[str, Any]) -> dict[str, Any]:
            (response,) = responses_of(post_ok(self.url + "/generate", body, self.timeout_s), 1)
            return response

        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies))) as pool:
            return list(pool.map(one, bodies))


