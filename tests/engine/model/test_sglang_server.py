"""SGLangServerBackend's HTTP plumbing end to end, against local stand-ins for an SGLang server and
a router (http.server on 127.0.0.1) that answer with the shapes of SGLang's source: single
`/generate` bodies in, `{text, output_ids, meta_info}` out, `/get_model_info`,
`/update_weights_from_disk`, a router's `/workers`. The stand-in's "model" is arithmetic, so every
expected value is computed by hand."""

from __future__ import annotations

import shutil

import pytest

from cleaner.engine.model import load_backend
from cleaner.engine.model.base import LENGTH, STOP, SamplingParams
from cleaner.engine.model.sglang_server import SGLangServerBackend
from cleaner.engine.model.sglang_wire import EngineError
from tests.helpers import StandIn


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


def test_weights_loaded_before_the_scheduler_went_idle_are_completed_by_a_flush_that_waits(server, model_dir,
                                                                                           tmp_path):
    backend = SGLangServerBackend(server.url, model_dir)
    server.busy_after_update = True
    new = tmp_path / "iteration-1"
    shutil.copytree(model_dir, new)
    backend.adopt(new)
    assert backend.model_path == new and server.model_path == str(new)
    assert [p for p, _ in server.requests][-2:] == ["/update_weights_from_disk", "/flush_cache?timeout=120"]
    server.idle_within_timeout = False
    with pytest.raises(EngineError, match="could not load weights from .*: HTTP 400: Timed out waiting for idle"):
        backend.adopt(model_dir)
    assert backend.model_path == new  # not recorded as served


def test_an_unreachable_server_is_an_engine_error(model_dir):
    stand_in = StandIn(str(model_dir))
    url = stand_in.url
    stand_in.close()
    with pytest.raises(EngineError, match=f"cannot reach sglang at {url}"):
        SGLangServerBackend(url, model_dir)
