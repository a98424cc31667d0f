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
- Faults (docs/architecture.md §5, "Faults and load"), as verl's server manager and SGLang's
  router handle them: a transient failure (a refused or reset connection, a timeout, HTTP 5xx or
  429: `ServerUnavailable`) takes its server out of the rotation and the request is tried again on
  another server at once, or, when none is left, after a back-off (`RETRY_BACKOFF_S`, doubling:
  1 + 2 + 4 + 8 s), `REQUEST_TRIES` tries in all; a rollout whose server failed moves to another
  for good. A server out of the rotation is probed (`GET /health`) once its own back-off
  (`PROBE_BACKOFF_S`, doubling to `MAX_PROBE_BACKOFF_S`) has passed, and whenever a request finds
  no server left; it comes back on the first answer, once it serves our checkpoint (a server
  restarted meanwhile is moved to it first, as at start). Any other refusal (HTTP
  4xx: a request the server will never take) is not tried again. Seeds travel with the request, so
  a request tried on another server samples the same tokens (deterministic inference, or greedy).
- The tokenizer (for the chat format) and the policy version (a hash of the weight files) come
  from the checkpoint on this machine.
- `tokens_computed` counts what the servers say they computed for scoring requests (prompt
  tokens minus `cached_tokens`), for the scorer's stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from cleaner.engine.model.answers import BadAnswer
from cleaner.engine.model.sglang_common import SGLangRequests
from cleaner.engine.model.sglang_wire import (
    FLUSH_WAIT_S,
    EngineError,
    check_answer,
    error_message,
    responses_of,
    served_model,
    update_weights_body,
    weights_in_cache_kept,
    worker_urls,
)
from cleaner.tools.calls import DaemonThreads

log = logging.getLogger(__name__)

# Connections to the servers, all together: enough to keep several servers' running batches full
# (SGLang runs up to a few hundred requests at once on a GPU); requests beyond it wait for one.
DEFAULT_CONCURRENCY = 512
MAX_REMEMBERED_SESSIONS = 100_000  # rollouts whose server is remembered (least recently used go)
REQUEST_TRIES = 5  # tries of a request that fails transiently, over every server
RETRY_BACKOFF_S = 1.0  # wait before a try when no server is left in the rotation; doubled each time
PROBE_BACKOFF_S = 1.0  # a failed server's first time out of the rotation; doubled at each failure ...
MAX_PROBE_BACKOFF_S = 60.0  # ... up to this
PROBE_TIMEOUT_S = 5.0  # a health probe's limit
CONTROL_TIMEOUT_S = 60.0  # the control plane's questions: which workers, which checkpoint
UPDATE_TIMEOUT_S = 3600.0  # a weight update: a large checkpoint loads for minutes
# A request's own limit, unless the user sets one (--sglang-request-timeout-s): a fixed part, plus
# what its tokens take at rates well below a loaded server's (20 new tokens/s for one request's
# decode in a full batch, 200 tokens/s of prefill), so only a server that stopped answering hits it.
REQUEST_BASE_S = 60.0
REQUEST_S_PER_NEW_TOKEN = 0.05
REQUEST_S_PER_INPUT_TOKEN = 0.005
_PROBE_THREADS = DaemonThreads("cleaner-probe")  # a probe's checkpoint check and weight update


class ServerUnavailable(EngineError):
    """A transient failure of one server (connection, timeout, 5xx, 429): tried again elsewhere."""


def retry_backoff_s(attempt: int) -> float:
    """The wait before try number `attempt` (1 = the first try again) of a request that found no
    server to answer it: RETRY_BACKOFF_S, doubling (1 + 2 + 4 + 8 s over REQUEST_TRIES tries)."""
    return RETRY_BACKOFF_S * 2 ** (attempt - 1)


def request_timeout_s(body: dict[str, Any], fixed_s: float | None = None) -> float:
    """How long one `/generate` body may wait for its answer: `fixed_s`, or the default derived
    from its tokens (module notes: REQUEST_BASE_S)."""
    if fixed_s is not None:
        return fixed_s
    return (REQUEST_BASE_S + REQUEST_S_PER_NEW_TOKEN * body["sampling_params"]["max_new_tokens"]
            + REQUEST_S_PER_INPUT_TOKEN * len(body["input_ids"]))


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


async def post_ok_async(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float) -> Any:
    """POST and return the parsed answer; a transient failure (no answer within `timeout_s`
    included) is ServerUnavailable, any other non-2xx status an EngineError, both with SGLang's
    message."""
    try:
        status, payload = _parsed(await client.post(url, json=body, timeout=httpx.Timeout(timeout_s, pool=None)))
    except httpx.TimeoutException as error:  # connected, or not, and no answer in time: a wedged server
        raise ServerUnavailable(f"sglang at {url} did not answer within {timeout_s:g} s ({type(error).__name__})") \
            from error
    except httpx.TransportError as error:  # refused, reset
        if _out_of_descriptors(error):  # ours, not the server's: benching it or trying again helps nothing
            raise EngineError(f"cannot open a connection to sglang at {url}: this process is out of file "
                              f"descriptors ({_descriptor_limit()}); lower --max-concurrent-rollouts or raise "
                              "`ulimit -n`") from error
        raise ServerUnavailable(f"cannot reach sglang at {url}: {error!r}") from error
    except httpx.HTTPError as error:
        raise EngineError(f"cannot reach sglang at {url}: {error!r}") from error
    if status >= 500 or status == 429:
        raise ServerUnavailable(f"POST {url}: HTTP {status}: {error_message(payload)}")
    if not 200 <= status < 300:
        raise EngineError(f"POST {url}: HTTP {status}: {error_message(payload)}")
    return payload


def _out_of_descriptors(error: BaseException | None, depth: int = 0) -> bool:
    """Whether `error` comes from this process (or the machine) running out of file descriptors:
    an EMFILE or ENFILE among its causes (httpx wraps httpcore's error, which wraps the OSError;
    anyio's "all connection attempts failed" holds each attempt's in a group)."""
    if error is None or depth > 16:
        return False
    if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
        return True
    if isinstance(error, BaseExceptionGroup) and any(_out_of_descriptors(e, depth + 1) for e in error.exceptions):
        return True
    return _out_of_descriptors(error.__cause__ or error.__context__, depth + 1)


def _descriptor_limit() -> str:
    try:
        import resource  # POSIX only: elsewhere the limit is not said
    except ImportError:
        return "its limit unknown"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"its limit: {soft}, at most {hard}"


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
    """Which server each rollout's requests go to, and which servers are in the rotation (see the
    module's notes): a rollout's first request goes to the least busy server in the rotation, every
    later one to the same server while it stays in."""

    def __init__(self, servers: list[str]) -> None:
        self.in_flight = dict.fromkeys(servers, 0)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.out: dict[str, float] = {}  # server out of the rotation -> when it may be probed (monotonic)
        self.backoff = dict.fromkeys(servers, PROBE_BACKOFF_S)  # its next time out of the rotation

    @property
    def rotation(self) -> list[str]:
        return [server for server in self.in_flight if server not in self.out]

    def server_for(self, session: str | None) -> str | None:
        """The server for `session`'s next request; None when every server is out of the rotation."""
        if session is not None and session in self.sessions and self.sessions[session] not in self.out:
            self.sessions.move_to_end(session)
            return self.sessions[session]
        rotation = self.rotation
        if not rotation:
            return None
        server = min(rotation, key=self.in_flight.__getitem__)  # the first of the least busy
        if session is not None:
            self.sessions[session] = server
            self.sessions.move_to_end(session)
            if len(self.sessions) > MAX_REMEMBERED_SESSIONS:
                self.sessions.popitem(last=False)
        return server

    def failed(self, server: str, now: float) -> None:
        """`server` failed transiently: out of the rotation until its back-off has passed."""
        if server not in self.out:
            self.out[server] = now + self.backoff[server]
            self.backoff[server] = min(2 * self.backoff[server], MAX_PROBE_BACKOFF_S)
            log.warning("%s is out of the rotation for %.0f s", server, self.out[server] - now)

    def recovered(self, server: str, answered: bool = True) -> None:
        """`server` is back in the rotation; `answered`: it answered a request (not only a health
        probe, which a wedged server may pass), so its next back-off starts short again."""
        if self.out.pop(server, None) is not None:
            log.info("%s answers again: back in the rotation", server)
        if answered:
            self.backoff[server] = PROBE_BACKOFF_S

    def due(self, now: float) -> list[str]:
        """Servers out of the rotation whose back-off has passed: to be probed."""
        return [server for server, when in self.out.items() if when <= now]

    def next_probe_in(self, now: float) -> float:
        """Seconds until the first server out of the rotation may be probed."""
        return max(min(self.out.values(), default=now) - now, 0.0)

    @contextlib.contextmanager
    def request(self, server: str) -> Iterator[str]:
        """`server`, counted as busy while the request runs."""
        self.in_flight[server] += 1
        try:
            yield server
        finally:
            self.in_flight[server] -= 1


# ---------------------------------------------------------------------------- backend


class SGLangServerBackend(SGLangRequests):
    """Generation and scoring through SGLang's native `/generate` on running servers."""

    def __init__(self, url: str, model_path: str | Path, *, max_concurrency: int = DEFAULT_CONCURRENCY,
                 request_timeout_s: float | None = None) -> None:
        """`request_timeout_s`: each request's limit, after which it is tried on another server and
        its server benched; None: derived from the request's tokens (`request_timeout_s()`)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if request_timeout_s is not None and not 0 < request_timeout_s < float("inf"):
            raise ValueError(f"request_timeout_s must be a number > 0, got {request_timeout_s}")
        self.url = url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self._read_checkpoint(model_path)
        self.workers = discover_workers(self.url, CONTROL_TIMEOUT_S)
        self.routes = StickyRoutes(self.workers)
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._probes: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Task] = {}  # health probes running
        log.info("sglang at %s: %d server(s) %s", self.url, len(self.workers), self.workers)
        self._serve(model_path)
        for worker in self.workers:
            if served_checkpoint(worker, CONTROL_TIMEOUT_S) != os.path.normpath(str(model_path)):
                self._update(worker, model_path)

    def adopt(self, model_path: str | Path) -> None:
        """Every server loads the checkpoint saved at `model_path` (same architecture)."""
        for worker in self.workers:
            self._update(worker, model_path)
        self._serve(model_path)

    def _update(self, worker: str, model_path: str | Path) -> None:
        status, answer = http_json(worker + "/update_weights_from_disk", update_weights_body(model_path),
                                   UPDATE_TIMEOUT_S)
        message = error_message(answer)
        if not 200 <= status < 300 and weights_in_cache_kept(message):  # weights in, flush when idle
            status, answer = http_json(f"{worker}/flush_cache?timeout={FLUSH_WAIT_S:g}", {},
                                       UPDATE_TIMEOUT_S + FLUSH_WAIT_S)
            message = error_message(answer)
        if not 200 <= status < 300 or isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"{worker} could not load weights from {model_path}: HTTP {status}: {message}")
        log.info("%s now serves %s", worker, model_path)

    def _serves_ours(self, worker: str) -> bool:
        """Whether `worker` serves the checkpoint we sample, after loading it there if it did not."""
        if served_checkpoint(worker, PROBE_TIMEOUT_S) != os.path.normpath(str(self._model_path)):
            self._update(worker, self._model_path)
        return True

    def close(self) -> None:
        """Nothing to release: the servers keep running."""

    # ------------------------------------------------------------------------ requests

    def _send(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST every body to the URL's `/generate` at once (at most `max_concurrency` connections),
        each tried again on a transient failure; responses in body order."""
        async def send_all() -> list[dict[str, Any]]:
            async with self._new_client() as client:
                return await asyncio.gather(*[self._post_retrying(client, self.url, body) for body in bodies])

        return asyncio.run(send_all()) if bodies else []

    async def _send_async(self, bodies: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
        """POST one rollout's bodies to its server (`StickyRoutes`), on this loop's connection pool."""
        client = self._client()
        return list(await asyncio.gather(*[self._post_routed(client, body, session) for body in bodies]))

    async def _post_routed(self, client: httpx.AsyncClient, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        """`body`'s response from `session`'s server, tried again elsewhere on a transient failure."""
        failure: ServerUnavailable | None = None
        for attempt in range(REQUEST_TRIES):
            server = await self._server_for(client, session, attempt)
            if server is None:
                continue
            try:
                with self.routes.request(server):
                    response = await self._post(client, server, body)
            except ServerUnavailable as error:
                failure = error
                self.routes.failed(server, time.monotonic())
                continue
            self.routes.recovered(server)
            return response
        raise EngineError(f"no server answered after {REQUEST_TRIES} tries: "
                          f"{failure if failure is not None else 'every server is out of the rotation'}")

    async def _server_for(self, client: httpx.AsyncClient, session: str | None, attempt: int) -> str | None:
        """A server in the rotation for `session`'s try number `attempt`: with none left, a back-off
        first (RETRY_BACKOFF_S, doubling) and every server out of the rotation probed; servers whose
        own back-off has passed are probed either way."""
        if attempt > 0 and not self.routes.rotation:
            await asyncio.sleep(retry_backoff_s(attempt))
        await self._probe_due(client, every=not self.routes.rotation)
        return self.routes.server_for(session)

    async def _probe_due(self, client: httpx.AsyncClient, every: bool = False) -> None:
        """Ask each server out of the rotation whose back-off has passed (`every`: each one)
        whether it is healthy, one probe a server at a time. The probes run beside the requests:
        only a request that finds no server left in the rotation waits for them (a probe may load
        our checkpoint onto a restarted server, which takes minutes)."""
        loop = asyncio.get_running_loop()
        due = list(self.routes.out) if every else self.routes.due(time.monotonic())
        for server in due:
            if (loop, server) not in self._probes:
                self._probes[loop, server] = loop.create_task(self._probe(client, server))
        running = [task for (owner, _), task in self._probes.items() if owner is loop]
        if running and not self.routes.rotation:
            await asyncio.gather(*[asyncio.shield(task) for task in running], return_exceptions=True)

    async def _probe(self, client: httpx.AsyncClient, server: str) -> None:
        """`GET /health`, then our checkpoint served: back in the rotation, or out for longer."""
        try:
            healthy = (await client.get(server + "/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
            if healthy:  # a server restarted meanwhile serves what it was started with: ours again first
                # on a daemon thread: a stop that cancels the probe does not wait at exit for a weight
                # update of up to UPDATE_TIMEOUT_S (asyncio.to_thread's pool threads are joined at exit)
                healthy = await asyncio.get_running_loop().run_in_executor(_PROBE_THREADS, self._serves_ours, server)
        except (httpx.HTTPError, EngineError) as error:
            log.debug("probe of %s failed: %r", server, error)
            healthy = False
        finally:
            self._probes.pop((asyncio.get_running_loop(), server), None)
        if healthy:
            self.routes.recovered(server, answered=False)
        else:
            self.routes.out.pop(server, None)
            self.routes.failed(server, time.monotonic())

    async def _post_retrying(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """`body`'s response from `url`, tried again after a back-off on a transient failure."""
        for attempt in range(REQUEST_TRIES):
            try:
                return await self._post(client, url, body)
            except ServerUnavailable as error:
                if attempt == REQUEST_TRIES - 1:
                    raise EngineError(f"no answer after {REQUEST_TRIES} tries: {error}") from error
                delay = retry_backoff_s(attempt + 1)
                log.warning("%s (try %d of %d); trying again in %.0f s", error, attempt + 1, REQUEST_TRIES, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def close_requests(self) -> None:
        """Stop the running loop's health probes and close its connection pool."""
        loop = asyncio.get_running_loop()
        probes = [task for (owner, _), task in list(self._probes.items()) if owner is loop]
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()

    async def _post(self, client: httpx.AsyncClient, server: str, body: dict[str, Any]) -> dict[str, Any]:
        """`server`'s answer to `body`, within the request's timeout. An answer no policy gives
        (answers.py) is the server's transient failure, like a 5xx: the request is tried elsewhere
        and the server benched."""
        answer = await post_ok_async(client, server + "/generate", body, request_timeout_s(body, self.request_timeout_s))
        (response,) = responses_of(answer, 1)
        try:
            check_answer(body, response, self.vocab_size)
        except BadAnswer as error:
            raise ServerUnavailable(f"{server} answered what no policy gives: {error}") from error
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
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(CONTROL_TIMEOUT_S, pool=None))  # requests set their own


