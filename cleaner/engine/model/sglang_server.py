"""The Backend protocol over HTTP: running SGLang servers, or a router in front of many, on any nodes.

Run against real SGLang 0.5.23 servers on CPU and sglang-router 0.3.2 in front of two of them, on
127.0.0.1 (`make test-sglang`: the contract suite on a server, `cleaner run` through the router).

Design decisions:
- HTTP through httpx (a client machine needs nothing beyond cleaner's own dependencies, and no
  sglang): the control plane (workers, model info, weight updates) with a blocking client, the
  requests with an `AsyncClient` per event loop and its connection pool (`max_concurrency`
  connections, kept alive; a request beyond them waits for a free one).
- Every request is a single `/generate` body. A router takes per-request seeds and starts only
  one request at a time (sglang_wire.py); a server batches concurrent requests itself.
- Where several servers serve (a router's workers), the agent loop's requests go straight to them,
  each rollout to one (`StickyRoutes`: a rollout's first request goes to the server with the fewest
  requests in flight, every later one to the same server), so the rollout's growing context stays in
  one radix cache, as verl's server manager keeps a request id on its server. The batch requests
  (purify's scorer, eval's warm-up) go to the URL given, whose router spreads them by its own policy.
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

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

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

# Connections to the servers, all together: enough to keep several servers' running batches full
# (SGLang runs up to a few hundred requests at once on a GPU); requests beyond it wait for one.
DEFAULT_CONCURRENCY = 512
MAX_REMEMBERED_SESSIONS = 100_000  # rollouts whose server is remembered (least recently used go)


# ---------------------------------------------------------------------------- HTTP


def _parsed(response: httpx.Response) -> tuple[int, Any]:
    """(status, parsed JSON body, or its text when it is not JSON)."""
    if not response.content:
        return response.status_code, None
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def http_json(url: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, Any]:
    """GET (body None) or POST JSON; (status, parsed body or text). Unreachable -> EngineError."""
    try:
        response = (httpx.get(url, timeout=timeout_s) if body is None
                    else httpx.post(url, json=body, timeout=timeout_s))
    except httpx.HTTPError as error:
        raise EngineError(f"cannot reach sglang at {url}: {error}") from error
    return _parsed(response)


async def post_ok_async(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    """POST and return the parsed answer; a non-2xx status is an EngineError with SGLang's message."""
    try:
        status, payload = _parsed(await client.post(url, json=body))
    except httpx.HTTPError as error:
        raise EngineError(f"cannot reach sglang at {url}: {error!r}") from error
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


class StickyRoutes:
    """Which server each rollout's requests go to: the least busy for its first request, the same
    one after (see the module's notes)."""

    def __init__(self, servers: list[str]) -> None:
        self.in_flight = dict.fromkeys(servers, 0)
        self.sessions: OrderedDict[str, str] = OrderedDict()

    def server_for(self, session: str | None) -> str:
        if session is not None and session in self.sessions:
            self.sessions.move_to_end(session)
            return self.sessions[session]
        server = min(self.in_flight, key=self.in_flight.__getitem__)  # the first of the least busy
        if session is not None:
            self.sessions[session] = server
            if len(self.sessions) > MAX_REMEMBERED_SESSIONS:
                self.sessions.popitem(last=False)
        return server

    @contextlib.contextmanager
    def request(self, session: str | None) -> Iterator[str]:
        """The server for `session`, counted as busy while the request runs."""
        server = self.server_for(session)
        self.in_flight[server] += 1
        try:
            yield server
        finally:
            self.in_flight[server] -= 1


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
        self.routes = StickyRoutes(self.workers)
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
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
        """POST every body to the URL's `/generate` at once (at most `max_concurrency` connections);
        responses in body order."""
        async def send_all() -> list[dict[str, Any]]:
            async with self._new_client() as client:
                return await asyncio.gather(*[self._post(client, self.url, body) for body in bodies])

        return asyncio.run(send_all()) if bodies else []

    async def _send_async(self, bodies: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
        """POST one rollout's bodies to its server (`StickyRoutes`), on this loop's connection pool."""
        client = self._client()
        with self.routes.request(session) as server:
            return list(await asyncio.gather(*[self._post(client, server, body) for body in bodies]))

    async def close_requests(self) -> None:
        """Close the running loop's connection pool."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def _post(self, client: httpx.AsyncClient, server: str, body: dict[str, Any]) -> dict[str, Any]:
        (response,) = responses_of(await post_ok_async(client, server + "/generate", body), 1)
        return response

    def _client(self) -> httpx.AsyncClient:
        """The running loop's client (an httpx client belongs to the loop it first ran on)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self._new_client()
        return client

    def _new_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.timeout_s, pool=None))


