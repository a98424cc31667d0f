"""SGLangServerBackend's HTTP plumbing end to end, against local stand-ins for an SGLang server and
a router (http.server on 127.0.0.1) that answer with the shapes of SGLang's source: single
`/generate` bodies in, `{text, output_ids, meta_info}` out, `/get_model_info`,
`/update_weights_from_disk`, a router's `/workers`. The stand-in's "model" is arithmetic, so every
expected value is computed by hand."""

from __future__ import annotations

import re
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
    server.delay_s = 0.3  # each answer waits long enough for the four requests to meet on a loaded machine
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


# ---------------------------------------------------------------------------- the agent loop's requests


def test_sticky_routes_keep_a_session_on_its_server_and_spread_new_ones():
    from cleaner.engine.model.sglang_server import StickyRoutes

    routes = StickyRoutes(["a", "b"])
    with routes.request(routes.server_for("r1")) as first:  # both idle: the first listed
        assert first == "a"
        with routes.request(routes.server_for("r2")) as second:  # a is busy: the least busy
            assert second == "b"
            with routes.request(routes.server_for("r1")) as again:  # r1 stays on a, busy or not
                assert again == "a"
    assert routes.in_flight == {"a": 0, "b": 0}
    assert routes.server_for("r2") == "b" and routes.server_for(None) == "a"


def test_a_failed_server_leaves_the_rotation_its_sessions_move_and_it_is_probed_back():
    from cleaner.engine.model.sglang_server import PROBE_BACKOFF_S, StickyRoutes

    routes = StickyRoutes(["a", "b"])
    assert routes.server_for("r1") == "a"
    routes.failed("a", now=100.0)
    assert routes.rotation == ["b"] and routes.server_for("r1") == "b"  # r1 moved for good
    assert routes.server_for("new") == "b"  # the idle failed server gets no new rollout
    assert routes.due(100.0 + PROBE_BACKOFF_S / 2) == [] and routes.due(100.0 + PROBE_BACKOFF_S) == ["a"]
    routes.failed("b", now=100.0)
    assert routes.server_for("r1") is None and routes.next_probe_in(100.0) == PROBE_BACKOFF_S
    routes.recovered("a")
    assert routes.server_for("r1") == "a"  # b is still out
    routes.failed("a", now=200.0)
    assert routes.out["a"] == 200.0 + PROBE_BACKOFF_S  # a recovery starts its back-off afresh
    routes.failed("a", now=300.0)  # already out: nothing changes until it is probed
    assert routes.out["a"] == 200.0 + PROBE_BACKOFF_S and routes.backoff["a"] == 2 * PROBE_BACKOFF_S


def test_requests_go_straight_to_the_routers_workers_each_rollout_to_one(model_dir):
    import asyncio

    workers = [StandIn(str(model_dir), delay_s=0.02) for _ in range(2)]
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    try:
        backend = SGLangServerBackend(router.url, model_dir)
        params = SamplingParams(max_new_tokens=2, stop_token_ids=())

        async def rollout(name: str, first: int) -> list[tuple[int, ...]]:
            turns = []
            for turn in range(3):  # a rollout's turns one after the other, as the agent loop sends them
                generation = await backend.generate_async([first + turn], params, seed=turn, session=name)
                turns.append(generation.token_ids)
            scored = await backend.score_async([[5, 6, 7]], [1], session=name)
            assert scored == [[-0.6, -0.7]]
            return turns

        async def main():
            try:
                return await asyncio.gather(*[rollout(f"r{i}", 10 * i) for i in range(6)])
            finally:
                await backend.close_requests()

        turns = asyncio.run(main())
        assert turns[1] == [(11, 12), (12, 13), (13, 14)]
        assert router.paths("/generate") == []  # nothing through the router itself
        served = [{body["input_ids"][0] // 10 for body in w.paths("/generate") if len(body["input_ids"]) == 1}
                  for w in workers]
        assert served[0] and served[1] and not served[0] & served[1]  # both used, no rollout on both
        assert sum(len(w.paths("/generate")) for w in workers) == 6 * 4
    finally:
        for stand_in in (*workers, router):
            stand_in.close()


def test_a_refused_request_fails_alone(server, model_dir):
    import asyncio

    from cleaner.engine.model.sglang_wire import score_body

    backend = SGLangServerBackend(server.url, model_dir)
    params = SamplingParams(max_new_tokens=2, stop_token_ids=())
    past_the_end = score_body([3, 4, 5], 3) | {"logprob_start_len": 3}  # the stand-in answers 400, as SGLang

    async def main():
        try:
            return await asyncio.gather(backend.generate_async([1, 2], params, 1, session="a"),
                                        backend._send_async([past_the_end], "b"),
                                        backend.score_async([[3, 4]], [1], session="c"), return_exceptions=True)
        finally:
            await backend.close_requests()

    generation, refused, scored = asyncio.run(main())
    assert generation.token_ids == (3, 4) and scored == [[-0.4]]
    assert isinstance(refused, EngineError) and "HTTP 400" in str(refused)


# ---------------------------------------------------------------------------- faults: nothing a server does changes what is stored


@pytest.fixture
def quick_retries(monkeypatch):
    """Back-offs of milliseconds instead of seconds (the rules are the same)."""
    from cleaner.engine.model import sglang_server

    monkeypatch.setattr(sglang_server, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setattr(sglang_server, "PROBE_BACKOFF_S", 0.2)
    monkeypatch.setattr(sglang_server, "MAX_PROBE_BACKOFF_S", 0.2)


@pytest.fixture(scope="module")
def healthy_collection(random_policy):
    """What a healthy server collects (`_collect_over`'s defaults): what every fault must leave."""
    healthy = StandIn(str(random_policy))
    try:
        expected, error = _collect_over(healthy.url, random_policy)
    finally:
        healthy.close()
    assert error is None
    return expected


def _collect_over(url: str, model_dir, prompts: int = 12, skip=frozenset(), request_timeout_s: float | None = None,
                  batch_rollouts: int = 4):
    """A collection of `prompts` x 2 single-turn rollouts through the servers behind `url`: the parts
    it wrote, and what it raised (None if it finished)."""
    from cleaner.config import CollectConfig
    from cleaner.engine.collect.schedule import collect
    from cleaner.engine.collect.tasks import toy_tasks
    from cleaner.engine.model.chat import ChatFormat
    from tests.agent_fakes import FakeSandbox, fake_reward

    backend = SGLangServerBackend(url, model_dir, request_timeout_s=request_timeout_s)
    config = CollectConfig(model=str(model_dir), backend="sglang", sglang_url=url, n_prompts=prompts, group_size=2,
                           max_turns=1, max_new_tokens=4, max_response_tokens=8, batch_rollouts=batch_rollouts,
                           sglang_request_timeout_s=request_timeout_s)
    parts = []
    try:
        collect(toy_tasks(prompts, seed=3), config, backend, FakeSandbox(), ChatFormat(backend.tokenizer),
                write=parts.append, reward_fn=fake_reward, skip_rollout_ids=skip, progress=False)
    except Exception as error:  # noqa: BLE001 - the test reads it
        return parts, error
    return parts, None


def _rows(parts):
    from tests.helpers import comparable

    return comparable([r for p in parts for r in p.rollouts], [s for p in parts for s in p.segments])


def test_a_server_that_dies_mid_collection_swallows_no_rollout(model_dir, healthy_collection, quick_retries):
    """Two workers behind a router; one hangs up on every request after serving 5: its rollouts'
    requests go to the other, every rollout is stored, and the warehouse is the one a healthy
    server collects."""
    expected = healthy_collection
    workers = [StandIn(str(model_dir), delay_s=0.01), StandIn(str(model_dir), delay_s=0.01)]
    workers[1].drop_after = 5
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    try:
        got, error = _collect_over(router.url, model_dir)
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert error is None
    assert _rows(got) == _rows(expected) and len(_rows(got)[0]) == 24
    served = [len(w.paths("/generate")) for w in workers]
    assert served[1] >= 5 and sum(served) == 24  # each rollout's request answered once


def test_the_only_server_dead_stops_the_collection_in_one_line_and_it_resumes(model_dir, healthy_collection, quick_retries):
    """One server, which hangs up after serving 6 requests: each later request is tried REQUEST_TRIES
    times, its rollout is not stored, and once failures are the rule the collection stops saying
    what is committed. A server on the same port again, the resumed collection completes the
    warehouse a healthy server collects."""
    from cleaner.errors import CollectionStopped

    expected = healthy_collection
    server = StandIn(str(model_dir))
    server.drop_after = 6
    try:
        got, error = _collect_over(server.url, model_dir)
    finally:
        server.close()
    assert isinstance(error, CollectionStopped)
    assert re.fullmatch(r"\d+ of the last \d+ requests failed \(last: EngineError: no server answered after 5 tries: "
                        r"cannot reach sglang at .*\); the collection stopped: \d+ of 24 rollouts are committed in "
                        r"\d+ parts, and --resume collects the rest once the backend is back", str(error)), str(error)
    stored = frozenset(r.rollout_id for p in got for r in p.rollouts)
    assert 0 < len(stored) < 24
    back = StandIn(str(model_dir), port=server.port)
    try:
        rest, error = _collect_over(back.url, model_dir, skip=stored)
    finally:
        back.close()
    assert error is None
    assert _rows(got + rest) == _rows(expected)


def test_a_stop_commits_every_rollout_that_finished_before_it(model_dir, healthy_collection, quick_retries):
    """Parts of 24 (the whole collection): the server dies after answering 6 requests, and the
    collection stops before any part fills. The rollouts that finished are committed all the same
    (a last part), the line counts them, and --resume collects only the others."""
    from cleaner.errors import CollectionStopped

    expected = healthy_collection
    server = StandIn(str(model_dir))
    server.drop_after = 6
    try:
        got, error = _collect_over(server.url, model_dir, batch_rollouts=24)
    finally:
        server.close()
    answered = len(server.paths("/generate"))
    stored = frozenset(r.rollout_id for p in got for r in p.rollouts)
    assert isinstance(error, CollectionStopped), error
    assert answered == 6
    assert "6 of 24 rollouts are committed in 1 parts" in str(error) and len(stored) == 6
    back = StandIn(str(model_dir), port=server.port)
    try:
        rest, error = _collect_over(back.url, model_dir, skip=stored, batch_rollouts=24)
    finally:
        back.close()
    assert error is None and len(back.paths("/generate")) == 18
    assert _rows(got + rest) == _rows(expected)


def test_a_server_answering_500_to_everything_stores_nothing_and_says_so(model_dir, quick_retries):
    from cleaner.errors import CollectionStopped

    server = StandIn(str(model_dir))
    server.generate = lambda body: (500, {"error": {"message": "Internal Server Error: scheduler died"}})
    try:
        parts, error = _collect_over(server.url, model_dir)
    finally:
        server.close()
    assert parts == [] and isinstance(error, CollectionStopped)
    assert "HTTP 500: Internal Server Error: scheduler died" in str(error)
    assert "0 of 24 rollouts are committed in 0 parts" in str(error)


def test_a_server_back_from_a_fault_is_probed_into_the_rotation(model_dir, quick_retries):
    """Worker b hangs up for a while: its sessions move to a; once b answers its health probe
    again (with our checkpoint), new rollouts go to it again."""
    import asyncio
    import time

    workers = [StandIn(str(model_dir)), StandIn(str(model_dir))]
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    params = SamplingParams(max_new_tokens=1, stop_token_ids=())
    try:
        backend = SGLangServerBackend(router.url, model_dir)
        workers[1].drop_after = 0

        async def main():
            try:
                await asyncio.gather(*[backend.generate_async([index], params, 0, session=f"early{index}")
                                       for index in range(4)])  # spread over both: b's fail, and move to a
                assert backend.routes.rotation == [workers[0].url]
                workers[1].drop_after = None  # b is back
                time.sleep(0.25)  # its back-off has passed
                await backend.generate_async([0], params, 0, session="probe")  # b is probed, beside the request
                for _ in range(100):  # the probe runs beside the requests: it answers within a moment
                    if workers[1].url in backend.routes.rotation:
                        break
                    await asyncio.sleep(0.02)
                await asyncio.gather(*[backend.generate_async([index], params, 0, session=f"late{index}")
                                       for index in range(4)])
            finally:
                await backend.close_requests()

        asyncio.run(main())
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert len(workers[1].paths("/generate")) >= 1 and workers[1].paths("/health")
    assert backend.routes.rotation == [workers[0].url, workers[1].url]


def test_collect_against_a_server_answering_500_exits_1_and_purify_refuses_the_iteration(model_dir, tmp_path,
                                                                                         quick_retries):
    """What a fault trial saw exit 0 with every rollout stored as `error`: now one error line, exit
    1, nothing stored, and the iteration is not purified (so `cleaner run` never trains on it)."""
    from typer.testing import CliRunner

    from cleaner.cli import app

    server = StandIn(str(model_dir))
    server.generate = lambda body: (500, {"error": {"message": "Internal Server Error"}})
    runner = CliRunner()
    try:
        result = runner.invoke(app, ["collect", "-w", str(tmp_path / "wh"), "--backend", "sglang", "--sglang-url",
                                     server.url, "--model", str(model_dir), "--prompts", "8", "--group-size", "2",
                                     "--max-turns", "1", "--max-new-tokens", "4", "--max-response-tokens", "8"])
    finally:
        server.close()
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HTTP 500" in errors[0] and "--resume" in errors[0], result.output
    assert "Traceback" not in result.output
    refused = runner.invoke(app, ["purify", "-w", str(tmp_path / "wh")])
    assert refused.exit_code == 1 and "holds 0 of the 16 rollouts" in " ".join(refused.output.split())


# ---------------------------------------------------------------------------- answers no policy gives


def _misanswering(stand_in: StandIn, how: str) -> StandIn:
    """`stand_in` answering every generation wrongly in one way (answers.py's cases)."""
    from cleaner.engine.model.loading import vocab_size_of

    honest = stand_in.generate

    def generate(body: dict) -> tuple[int, object]:
        status, payload = honest(body)
        meta = payload["meta_info"]
        entries = meta["output_token_logprobs"]
        if how == "id past the vocabulary":
            entries[0][1] = vocab_size_of(stand_in.model_path)  # the first id past the checkpoint's
        elif how == "NaN log-prob":
            entries[0][0] = float("nan")  # json.dumps writes NaN, which httpx reads back as nan
        elif how == "positive log-prob":
            entries[0][0] = 0.7
        elif how == "empty, not stopped":
            meta["output_token_logprobs"], meta["completion_tokens"] = [], 0
        elif how == "length disagrees":
            meta["completion_tokens"] += 1
        return status, payload

    stand_in.generate = generate
    return stand_in


HOW = ["id past the vocabulary", "NaN log-prob", "positive log-prob", "empty, not stopped", "length disagrees"]


@pytest.mark.parametrize("how", HOW)
def test_a_server_answering_what_no_policy_gives_is_routed_around(model_dir, healthy_collection, quick_retries, how):
    """Two workers behind a router, one answering every generation wrongly: each such answer is a
    fault of that server (benched, the request tried on the other), so the warehouse is the one a
    healthy server collects and holds nothing the bad server said."""
    expected = healthy_collection
    workers = [StandIn(str(model_dir)), _misanswering(StandIn(str(model_dir)), how)]
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    try:
        got, error = _collect_over(router.url, model_dir)
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert error is None
    assert workers[1].paths("/generate")  # it was asked, and its answers were refused
    assert _rows(got) == _rows(expected) and len(_rows(got)[0]) == 24


@pytest.mark.parametrize("how", HOW)
def test_the_only_server_answering_what_no_policy_gives_stops_the_collection_and_it_resumes(model_dir, healthy_collection, quick_retries,
                                                                                          how):
    from cleaner.errors import CollectionStopped

    expected = healthy_collection
    server = _misanswering(StandIn(str(model_dir)), how)
    try:
        got, error = _collect_over(server.url, model_dir)
    finally:
        server.close()
    assert got == [] and isinstance(error, CollectionStopped), error
    assert "answered what no policy gives" in str(error) and "--resume" in str(error)
    assert "\n" not in str(error)
    back = StandIn(str(model_dir), port=server.port)
    try:
        rest, error = _collect_over(back.url, model_dir)
    finally:
        back.close()
    assert error is None and _rows(rest) == _rows(expected)


# ---------------------------------------------------------------------------- a server that takes requests and never answers


def test_a_requests_default_timeout_follows_its_tokens_not_an_hour():
    from cleaner.engine.model.sglang_server import request_timeout_s
    from cleaner.engine.model.sglang_wire import generate_body, score_body

    params = SamplingParams(max_new_tokens=8192, stop_token_ids=())
    assert request_timeout_s(generate_body([1] * 16_000, params, 0)) == pytest.approx(60 + 0.05 * 8192 + 0.005 * 16_000)
    assert request_timeout_s(score_body([1] * 2_000, 1)) == pytest.approx(60 + 0.005 * 2_000)
    assert request_timeout_s(score_body([1] * 2_000, 1), fixed_s=7.5) == 7.5


def test_a_wedged_server_is_timed_out_and_routed_around(model_dir, healthy_collection, quick_retries):
    """Two workers, one of which takes every generation and never answers: each request to it ends
    at the request timeout, is tried on the other, and the wedged server leaves the rotation; the
    warehouse is the one a healthy server collects."""
    import time

    expected = healthy_collection
    workers = [StandIn(str(model_dir)), StandIn(str(model_dir))]
    workers[1].wedged = {"/generate", "/health"}  # its probes hang too (PROBE_TIMEOUT_S): it stays out
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    started = time.monotonic()
    try:  # 2 s: a healthy stand-in answers well within it even on a loaded machine
        got, error = _collect_over(router.url, model_dir, request_timeout_s=2.0)
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert error is None, error
    assert workers[1].paths("/generate")  # it took requests
    assert _rows(got) == _rows(expected) and len(_rows(got)[0]) == 24
    assert time.monotonic() - started < 30


def test_the_only_server_wedged_ends_the_collection_as_a_dead_one_and_it_resumes(model_dir, healthy_collection, quick_retries):
    from cleaner.errors import CollectionStopped

    expected = healthy_collection
    server = StandIn(str(model_dir))
    server.wedged = {"/generate"}
    try:
        got, error = _collect_over(server.url, model_dir, request_timeout_s=0.3)
    finally:
        server.close()
    assert got == [] and isinstance(error, CollectionStopped), error
    assert "did not answer within 0.3 s" in str(error) and "--resume" in str(error) and "\n" not in str(error)
    back = StandIn(str(model_dir), port=server.port)
    try:
        rest, error = _collect_over(back.url, model_dir)
    finally:
        back.close()
    assert error is None and _rows(rest) == _rows(expected)


def test_a_probe_that_passes_does_not_shorten_a_wedged_servers_back_off(model_dir, monkeypatch):
    """Worker b passes its health probe but never answers a generation (a wedged scheduler behind a
    live HTTP front). The probe brings it back; only an answered request would start its back-off
    short again, so each time it is found wedged it stays out twice as long: 0.4 s, then 0.8 s."""
    import asyncio
    import time

    from cleaner.engine.model import sglang_server

    monkeypatch.setattr(sglang_server, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setattr(sglang_server, "PROBE_BACKOFF_S", 0.2)
    monkeypatch.setattr(sglang_server, "MAX_PROBE_BACKOFF_S", 60.0)
    workers = [StandIn(str(model_dir)), StandIn(str(model_dir))]
    workers[1].wedged = {"/generate"}
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    wedged = workers[1].url
    params = SamplingParams(max_new_tokens=1, stop_token_ids=())
    backoffs = []
    try:
        # a's answers must come within the timeout too (else a is benched and the counts change): 1.5 s
        # leaves a loaded machine room, and b's wedged requests still time out
        backend = SGLangServerBackend(router.url, model_dir, request_timeout_s=1.5)

        async def main():
            try:
                for round_ in range(2):  # two rollouts at once: the second goes to b (a is busy) and times out there
                    await asyncio.gather(*[backend.generate_async([index], params, 0, session=f"r{round_}-{index}")
                                           for index in range(2)])
                    assert wedged not in backend.routes.rotation
                    backoffs.append(backend.routes.backoff[wedged])
                    if round_ == 0:
                        time.sleep(0.25)  # its back-off has passed: the next request probes it, beside
                        await backend.generate_async([5], params, 0, session="probe")
                        for _ in range(200):
                            if wedged in backend.routes.rotation:
                                break
                            await asyncio.sleep(0.01)
                        assert wedged in backend.routes.rotation  # its health probe passed
            finally:
                await backend.close_requests()

        asyncio.run(main())
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert len(workers[1].paths("/generate")) == 2 and workers[1].paths("/health")
    assert backoffs == [0.4, 0.8]


def test_a_routed_request_never_waits_on_a_probe_while_a_server_serves(model_dir, quick_retries):
    """Worker b is out of the rotation and its health probe hangs (a probe may load our checkpoint
    for minutes): requests of rollouts keep going to a, each as fast as a answers."""
    import asyncio
    import time

    workers = [StandIn(str(model_dir)), StandIn(str(model_dir))]
    router = StandIn(str(model_dir), workers=[w.url for w in workers])
    params = SamplingParams(max_new_tokens=1, stop_token_ids=())
    try:
        backend = SGLangServerBackend(router.url, model_dir)
        backend.routes.failed(workers[1].url, time.monotonic() - 10)  # out, and due for a probe at once
        workers[1].wedged = {"/health"}

        async def main():
            try:
                started = time.monotonic()
                for index in range(5):
                    await backend.generate_async([index], params, 0, session=f"r{index}")
                return time.monotonic() - started
            finally:
                await backend.close_requests()

        seconds = asyncio.run(main())
    finally:
        for stand_in in (router, *workers):
            stand_in.close()
    assert workers[1].paths("/health")  # it was probed ...
    assert seconds < 2.0  # ... and nobody waited for the probe (PROBE_TIMEOUT_S is 5 s)
    assert len(workers[0].paths("/generate")) == 5


# ---------------------------------------------------------------------------- the back-off with no server left


class _RecordedSleeps:
    """The asyncio module as sglang_server sees it, but its sleeps are recorded and return at once."""

    def __init__(self) -> None:
        import asyncio

        self.asyncio, self.slept = asyncio, []

    def __getattr__(self, name):
        return getattr(self.asyncio, name)

    async def sleep(self, delay):
        self.slept.append(delay)


def test_with_no_server_left_a_request_backs_off_1_2_4_8_seconds_then_fails(model_dir, monkeypatch):
    """The documented back-off (docs/running.md: a dead last server stops a collection in about
    30 s): four waits of 1, 2, 4 and 8 s between the five tries, on the routed and the batch path."""
    import asyncio

    from cleaner.engine.model import sglang_server

    server = StandIn(str(model_dir))
    try:
        backend = SGLangServerBackend(server.url, model_dir)
        server.drop_after = 0  # every request from now on: the connection drops
        clock = _RecordedSleeps()
        monkeypatch.setattr(sglang_server, "asyncio", clock)
        params = SamplingParams(max_new_tokens=1, stop_token_ids=())

        async def routed():
            try:
                return await backend.generate_async([1], params, 0, session="r")
            finally:
                await backend.close_requests()

        with pytest.raises(EngineError, match="no server answered after 5 tries"):
            asyncio.run(routed())
        assert clock.slept == [1.0, 2.0, 4.0, 8.0]
        clock.slept.clear()
        with pytest.raises(EngineError, match="no answer after 5 tries"):
            backend.generate([[1]], params, seeds=[0])
        assert clock.slept == [1.0, 2.0, 4.0, 8.0]
    finally:
        server.close()


PROBE_STOPPED_MID_UPDATE = '''
import asyncio, sys, time
sys.path.insert(0, sys.argv[2])
from cleaner.engine.model import sglang_server
from cleaner.engine.model.base import SamplingParams
from cleaner.engine.model.sglang_server import SGLangServerBackend
from tests.helpers import StandIn

sglang_server.RETRY_BACKOFF_S, sglang_server.PROBE_BACKOFF_S, sglang_server.MAX_PROBE_BACKOFF_S = 0.01, 0.2, 0.2
model = sys.argv[1]
workers = [StandIn(model), StandIn(model)]
router = StandIn(model, workers=[w.url for w in workers])
backend = SGLangServerBackend(router.url, model)
params = SamplingParams(max_new_tokens=1, stop_token_ids=())

async def main():
    workers[1].drop_after = 0
    await asyncio.gather(*[backend.generate_async([i], params, 0, session=f"early{i}") for i in range(4)])
    workers[1].model_path = "/restarted/with/another/checkpoint"  # b comes back restarted: its probe loads ours ...
    workers[1].wedged = {"/update_weights_from_disk"}  # ... which never ends
    workers[1].drop_after = None
    time.sleep(0.25)  # b's back-off has passed: the next request probes it, beside
    await backend.generate_async([0], params, 0, session="probe")
    for _ in range(500):
        if workers[1].paths("/update_weights_from_disk"):
            break
        await asyncio.sleep(0.01)
    assert workers[1].paths("/update_weights_from_disk"), "the probe never loaded our checkpoint"
    await backend.close_requests()  # a stop: the probe is cancelled mid-update

asyncio.run(main())
print("stopped", flush=True)
'''


def test_a_stop_during_a_probes_weight_update_does_not_hold_the_exit(model_dir):
    """A server restarted with another checkpoint is probed back: the probe loads ours onto it, and
    that load never ends. The collection stops meanwhile (its probes cancelled): the process exits at
    once, not after the update's hour-long limit (a pool thread of asyncio.to_thread is joined at
    exit; the probe's is a daemon thread)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    process = subprocess.Popen([sys.executable, "-c", PROBE_STOPPED_MID_UPDATE, str(model_dir), root],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the process did not exit within 60 s of its stop; it wrote:\n{out}\n{err[-3000:]}")
    assert process.returncode == 0, err
    assert out.splitlines() == ["stopped"]


@pytest.mark.parametrize("wrapped", ["chained", "grouped"])
def test_a_process_out_of_descriptors_is_said_as_such_and_never_benches_the_server(wrapped):
    """A connection that cannot open because this process ran out of descriptors (EMFILE) is not the
    server's fault: no ServerUnavailable (which benches the server and tries again), but an error
    saying what ran out and what to do. Refused connections stay the server's transient failure.
    The OSError sits under httpx's and httpcore's errors, or in anyio's group of attempts."""
    import asyncio
    import errno
    import os

    import httpx

    from cleaner.engine.model.sglang_server import ServerUnavailable, post_ok_async
    from cleaner.engine.model.sglang_wire import EngineError

    def failing(code: int):
        def handler(request):
            cause = OSError(code, os.strerror(code))
            if wrapped == "grouped":
                try:
                    raise OSError("All connection attempts failed") from ExceptionGroup("attempts", [cause])
                except OSError as error:
                    cause = error
            raise httpx.ConnectError("connect failed", request=request) from cause
        return handler

    async def post(code: int):
        async with httpx.AsyncClient(transport=httpx.MockTransport(failing(code))) as client:
            return await post_ok_async(client, "http://server/generate", {}, 5.0)

    with pytest.raises(EngineError, match=r"^cannot open a connection to sglang at http://server/generate: this "
                                          r"process is out of file descriptors \(its limit: \d+, at most \d+\); lower "
                                          r"--max-concurrent-rollouts or raise `ulimit -n`$") as raised:
        asyncio.run(post(errno.EMFILE))
    assert not isinstance(raised.value, ServerUnavailable)
    with pytest.raises(ServerUnavailable, match="^cannot reach sglang at http://server/generate"):
        asyncio.run(post(errno.ECONNREFUSED))
