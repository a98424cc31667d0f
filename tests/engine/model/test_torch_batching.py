"""Continuous batching of the torch backend (torch_batching.py) on a tiny random Qwen3: rows that join
a running batch, leave it, or are cancelled decode what they would alone; the decoding thread admits
within its bounds, runs other work between steps and fails only the batch whose forward raised."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from cleaner.engine.model.base import LENGTH, STOP, Generation, SamplingParams
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.model.torch_batching import DecodeBatch, DecodeRequest, DecodeServer, run_to_end

PROMPTS = [[1, 5, 9, 13, 2], [3, 4], [7, 7, 7, 8, 9, 10, 11, 12, 20], [30, 31, 32]]
ATOL = 1e-5  # float32 rounding between batches of other shapes


@pytest.fixture(scope="module")
def backend(tiny_qwen3_dir):
    torch.set_num_threads(2)
    backend = TorchBackend(tiny_qwen3_dir)
    yield backend
    backend.close()


def _request(prompt, seed, max_new_tokens=12, stop=(), results=None, **params):
    results = {} if results is None else results
    key = (tuple(prompt), seed)
    return DecodeRequest(tuple(prompt), SamplingParams(max_new_tokens, tuple(stop), **params), seed,
                         lambda result: results.__setitem__(key, result)), results


def _alone(backend, prompt, seed, max_new_tokens=12, **params) -> Generation:
    return backend.generate([prompt], SamplingParams(max_new_tokens, (), **params), [seed])[0]


def _close(got: Generation, expected: Generation) -> None:
    assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
    assert got.logprobs == pytest.approx(expected.logprobs, abs=ATOL)


def test_rows_that_join_a_running_batch_sample_what_they_would_alone(backend):
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    results: dict = {}
    first = [_request(PROMPTS[0], 1, 20, results=results)[0], _request(PROMPTS[1], 2, 5, results=results)[0]]
    batch.admit(first)
    for _ in range(3):
        batch.step()
    late = [_request(PROMPTS[2], 3, 12, results=results)[0], _request(PROMPTS[3], 4, 12, results=results,
                                                                        temperature=0.0)[0]]
    batch.admit(late)  # they join rows 3 tokens in, with another padding
    while batch.rows:
        batch.step()
    assert len(results) == 4
    _close(results[(tuple(PROMPTS[0]), 1)], _alone(backend, PROMPTS[0], 1, 20))
    _close(results[(tuple(PROMPTS[1]), 2)], _alone(backend, PROMPTS[1], 2, 5))
    _close(results[(tuple(PROMPTS[2]), 3)], _alone(backend, PROMPTS[2], 3, 12))
    _close(results[(tuple(PROMPTS[3]), 4)], _alone(backend, PROMPTS[3], 4, 12, temperature=0.0))
    assert results[(tuple(PROMPTS[1]), 2)].finish_reason == LENGTH


def test_ended_rows_are_compacted_away_and_the_rest_decode_on(backend):
    # eight rows, six of which end after 2 tokens: the cache is rebuilt with the two that go on
    requests, results = [], {}
    for index in range(8):
        request, _ = _request(PROMPTS[index % 4], 10 + index, 2 if index < 6 else 15, results=results)
        requests.append(request)
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    batch.admit(requests)
    batch.step()
    batch.step()  # six rows end here
    assert len(batch.rows) == 2 and all(row is not None for row in batch.rows)  # compacted
    assert batch.layers[0].length == batch.mask.shape[1] == max(len(PROMPTS[2]), len(PROMPTS[3])) + 2
    while batch.rows:
        batch.step()
    for index in range(8):
        prompt, seed = PROMPTS[index % 4], 10 + index
        _close(results[(tuple(prompt), seed)], _alone(backend, prompt, seed, 2 if index < 6 else 15))


def test_a_stop_token_ends_a_row_and_is_kept(backend):
    reference = _alone(backend, PROMPTS[2], 7, 8, temperature=0.0)
    stop = reference.token_ids[3]
    cut = reference.token_ids.index(stop)
    request, results = _request(PROMPTS[2], 7, 8, stop=(stop,), temperature=0.0)
    run_to_end(DecodeBatch(backend.model, backend.device, backend.pad_id), [request])
    (generation,) = results.values()
    assert generation.token_ids == reference.token_ids[:cut + 1] and generation.finish_reason == STOP


def test_a_cancelled_row_leaves_without_an_answer(backend):
    cancelled = threading.Event()
    results: dict = {}
    gone = DecodeRequest(tuple(PROMPTS[0]), SamplingParams(50, ()), 1, lambda r: results.__setitem__("gone", r),
                         cancelled=cancelled.is_set)
    kept, _ = _request(PROMPTS[1], 2, 10, results=results)
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    batch.admit([gone, kept])
    batch.step()
    cancelled.set()
    batch.step()
    assert [row is gone for row in batch.rows] == [False]  # marked, then compacted away
    while batch.rows:
        batch.step()
    assert "gone" not in results and len(results) == 1


# ---------------------------------------------------------------------------- the decoding thread


def test_the_server_admits_within_its_row_and_token_bounds(backend):
    server = DecodeServer(lambda: DecodeBatch(backend.model, backend.device, backend.pad_id), max_rows=2,
                          max_tokens=10_000)
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    waiting = [_request(prompt, seed)[0] for seed, prompt in enumerate(PROMPTS)]
    from collections import deque

    queue = deque(waiting)
    assert server._admissible(batch, queue) == waiting[:2] and len(queue) == 2
    tight = DecodeServer(server.new_batch, max_rows=8, max_tokens=2 * len(PROMPTS[2]))
    queue = deque([waiting[2], waiting[0], waiting[1]])
    # the first always goes in; the second makes 2 rows x 9 columns = 18 <= 18, a third 27
    assert tight._admissible(batch, queue) == [waiting[2], waiting[0]] and list(queue) == [waiting[1]]


def test_requests_from_an_event_loop_and_scoring_between_steps(backend):
    params = SamplingParams(10, ())

    async def main():
        generations = asyncio.gather(*[backend.generate_async(p, params, seed) for seed, p in enumerate(PROMPTS)])
        scored = backend.score_async([PROMPTS[2] + [4, 4]], [len(PROMPTS[2])])
        return await generations, await scored

    generations, scored = asyncio.run(main())
    alone = backend.generate(PROMPTS, params, list(range(len(PROMPTS))))
    for got, expected in zip(generations, alone, strict=True):
        _close(got, expected)
    assert scored[0] == pytest.approx(backend.score([PROMPTS[2] + [4, 4]], [len(PROMPTS[2])])[0], abs=ATOL)
    steps, rows = backend.decode_stats
    assert steps >= 10 and rows >= 40  # every request decoded 10 tokens on the thread


def test_a_collection_that_stopped_leaves_the_thread_serving_the_next(tiny_qwen3_dir):
    """Requests whose loop was closed under them (an interrupted collection) finish or leave
    without their answers; the decoding thread serves the next loop's requests."""
    backend = TorchBackend(tiny_qwen3_dir)
    params = SamplingParams(40, ())
    loop = asyncio.new_event_loop()

    async def abandon():
        pending = [asyncio.create_task(backend.generate_async(p, params, seed)) for seed, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.01)
        return pending

    loop.run_until_complete(abandon())
    loop.close()  # with its tasks still waiting, as an interrupted collect leaves them
    try:
        generation = asyncio.run(backend.generate_async(PROMPTS[0], SamplingParams(5, ()), 9))
        assert len(generation.token_ids) == 5
        assert backend._server._thread.is_alive()
    finally:
        backend.close()
    late = backend._server.call(lambda: 1)  # after close: answered with an error, never left hanging
    with pytest.raises(RuntimeError, match="closed"):
        late.result(timeout=10)


def test_a_forward_that_raises_fails_its_batch_only(backend):
    class Exploding(torch.nn.Module):
        def forward(self, **kwargs):
            raise RuntimeError("CUDA error: out of memory")

    models = iter([Exploding(), backend.model])
    server = DecodeServer(lambda: DecodeBatch(next(models), backend.device, backend.pad_id))

    async def one(prompt, seed):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        server.submit(DecodeRequest(tuple(prompt), SamplingParams(4, ()), seed,
                                    lambda r: loop.call_soon_threadsafe(_settle, future, r)))
        return await future

    async def main():
        try:
            await one(PROMPTS[0], 1)
        except RuntimeError as error:
            failed = str(error)
        return failed, await one(PROMPTS[1], 2)  # the next batch runs on the next model

    failed, generation = asyncio.run(main())
    server.close()
    assert failed == "CUDA error: out of memory"
    _close(generation, _alone(backend, PROMPTS[1], 2, 4))


def _settle(future, result):
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
