"""SGLangServerBackend's HTTP plumbing end to end, against local stand-ins for an SGLang server and
a router (http.server on 127.0.0.1) that answer with the shapes of SGLang's source: single
`/generate` bodies in, `{text, output_ids, meta_info}` out, `/get_model_info`,
`/update_weights_from_disk`, a router's `/workers`. The stand-in's "model" is arithmetic, so every
expected value is computed by hand."""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cleaner.engine.model import load_backend
from cleaner.engine.model.base import LENGTH, STOP, SamplingParams
from cleaner.engine.model.sglang_server import SGLangServerBackend
from cleaner.engine.model.sglang_wire import EngineError


class StandIn:
    """One stand-in server: its model emits last + 1 (mod 64), log-prob -0.5 per token; an input
    token t scores -t / 10. `workers` makes it a router listing those URLs."""

    def __init__(self, model_path: str, workers: list[str] | None = None, delay_s: float = 0.0) -> None:
        self.model_path, self.workers, self.delay_s = model_path, workers, delay_s
        self.requests: list[tuple[str, dict | None]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[int, object]:
        ids, params, start = body["input_ids"], body["sampling_params"], body["logprob_start_len"]
        if not isinstance(ids[0], int) or not isinstance(params, dict):
            return 400, {"error": {"message": "the stand-in takes single requests"}}
        if start >= len(ids):
            return 400, {"error": {"message": f"logprob_start_len, ({start}) is higher than the number of input tokens"}}
        output, finish = [], {"type": "length", "length": params["max_new_tokens"]}
        while len(output) < params["max_new_tokens"]:
            output.append((output[-1] if output else ids[-1]) + 1 & 63)
            if output[-1] in params.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": output[-1]}
                break
        inputs = [[None if j == 0 else -t / 10, t, None] for j, t in enumerate(ids[start:])]
        meta = {"id": "x", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(output),
                "cached_tokens": 0, "input_token_logprobs": inputs,
                "output_token_logprobs": [[-0.5, t, None] for t in output]}
        return 200, {"text": "", "output_ids": output, "meta_info": meta}

    def answer(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        self.requests.append((path, body))
        if path == "/generate" and method == "POST":
            return self.generate(body)
        if path == "/workers" and self.workers is not None:
            return 200, {"workers": [{"id": str(i), "url": u} for i, u in enumerate(self.workers)],
                         "total": len(self.workers), "stats": {}}
        if path == "/get_model_info" and self.workers is None:
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        if path == "/update_weights_from_disk" and self.workers is None:
            if "missing" in body["model_path"]:
                return 400, {"success": False, "message": "no such checkpoint", "num_paused_requests": 0}
            self.model_path = body["model_path"]
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return 404, {"detail": "Not Found"}

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with stand_in.lock:
                    stand_in.in_flight += 1
                    stand_in.most_in_flight = max(stand_in.most_in_flight, stand_in.in_flight)
                time.sleep(stand_in.delay_s)
                status, payload = stand_in.answer(method, self.path, body)
                with stand_in.lock:
                    stand_in.in_flight -= 1
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply("GET")

            def do_POST(self):
                self._reply("POST")

            def log_message(self, *args):
                pass

        return Handler

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def paths(self, path: str) -> list[dict | None]:
        return [body for p, body in self.requests if p == path]


@pytest.fixture
def model_dir(random_policy):
    return random_policy


@pytest.fixture
def server(model_dir):
    stand_in = StandIn(str(model_dir), delay_s=0.05)
    yield stand_in
    stand_in.close()


def test_generate_sends_single_requests_concurrently_and_keeps_their_order(server, model_dir):
    backend = load_backend("sglang", model_dir, sglang_url=server.url + "/")
    assert backend.tokenizer is not None  # the checkpoint's own, loaded here
    assert backend.workers == [server.url]  # no worker list: the URL is a server
    assert server.paths("/update_weights_from_disk") == []  # it already serves the checkpoint
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(12,), temperature=1.0)
    prompts = [[1, 2, 3], [9, 10], [40], [62]]
    generations = backend.generate(prompts, params, seeds=[7, 8, 9, 10])
    assert [g.token_ids for g in generations] == [(4, 5, 6), (11, 12), (41, 42, 43), (63, 0, 1)]
    assert [g.finish_reason for g in generations] == [LENGTH, STOP, LENGTH, LENGTH]
    assert generations[1].logprobs == (-0.5, -0.5)
    bodies = server.paths("/generate")
    assert sorted(body["sampling_params"]["sampling_seed"] for body in bodies) == [7, 8, 9, 10]
    assert all(body["sampling_params"]["stop_token_ids"] == [12] for body in bodies)
    assert server.most_in_flight > 1  # the four requests overlapped


def test_score_reads_input_logprobs_and_sends_nothing_for_empty_rows(server, model_dir):
    backend = SGLangServerBackend(server.url, model_dir)
    scored = backend.score([[5, 6, 7, 8], [3, 4], [9]], [2, 2, 1])
    assert scored == [[-0.7, -0.8], [], []]
    assert [body["logprob_start_len"] for body in server.paths("/generate")] == [1]
    assert backend.tokens_computed == 4  # the stand-in caches nothing: its whole prompt
    scorer = backend.scorer()
    assert scorer.score_rows([[5, 6, 7, 8], [5, 6, 9]], [2, 2]) == [[-0.7, -0.8], [-0.9]]
    # requests [5, 6] (the shared prefix, for its last token), then [5, 6, 7, 8] and [5, 6, 9]
    assert scorer.stats.tokens_computed == 2 + 4 + 3


def test_concurrency_is_bounded(model_dir):
    stand_in = StandIn(str(model_dir), delay_s=0.05)
    try:
        backend = SGLangServerBackend(stand_in.url, model_dir, max_concurrency=1)
        backend.generate([[1], [2], [3]], SamplingParams(max_new_tokens=1, stop_token_ids=()), [0, 0, 0])
        assert stand_in.most_in_flight == 1
    finally:
        stand_in.close()


def test_a_router_spreads_requests_and_each_worker_gets_the_weights(model_dir, tmp_path):
    other = tmp_path / "base"
    workers = [StandIn(str(model_dir)), StandIn(str(other))]
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    try:
        backend = SGLangServerBackend(router.url, model_dir)
        assert backend.workers == [w.url for w in workers]
        # at start, only the worker serving another checkpoint is moved to ours
        assert workers[0].paths("/update_weights_from_disk") == []
        assert workers[1].paths("/update_weights_from_disk") == [{"model_path": str(model_dir)}]
        backend.generate([[1, 2]], SamplingParams(max_new_tokens=1, stop_token_ids=()), [0])
        assert len(router.paths("/generate")) == 1  # generation goes through the router
        new = tmp_path / "iteration-1"
        shutil.copytree(model_dir, new)
        before = backend.policy_version
        backend.adopt(new)
        assert [w.model_path for w in workers] == [str(new), str(new)]
        assert backend.model_path == new
        assert backend.policy_version.startswith("iteration-1@") and backend.policy_version != before
        assert router.paths("/update_weights_from_disk") == []  # the router has no such endpoint
    finally:
        for stand_in in (router, *workers):
            stand_in.close()


def test_a_router_that_lists_no_workers_yet_is_an_engine_error(model_dir):
    router = StandIn(str(model_dir), workers=[])
    try:
        with pytest.raises(EngineError, match=f"the router at {router.url} lists no workers"):
            SGLangServerBackend(router.url, model_dir)
    finally:
        router.close()


def test_refusals_are_engine_errors_with_the_servers_message(server, model_dir, tmp_path):
    backend = SGLangServerBackend(server.url, model_dir)
    with pytest.raises(EngineError, match="no such checkpoint"):
        backend.adopt(tmp_path / "missing")
    assert backend.model_path == model_dir  # still the old checkpoint
    server.generate = lambda body: (400, {"error": {"message": "input is longer than the context"}})
    with pytest.raises(EngineError, match="HTTP 400: input is longer than the context"):
        backend.generate([[1]], SamplingParams(max_new_tokens=1, stop_token_ids=()), [0])


def test_an_unreachable_server_is_an_engine_error(model_dir):
    stand_in = StandIn(str(model_dir))
    url = stand_in.url
    stand_in.close()
    with pytest.raises(EngineError, match=f"cannot reach sglang at {url}"):
        SGLangServerBackend(url, model_dir)
