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
    # eight rows, six of which end after 2 tokens: the batch keeps only the two that go on
    requests, results = [], {}
    for index in range(8):
        request, _ = _request(PROMPTS[index % 4], 10 + index, 2 if index < 6 else 15, results=results)
        requests.append(request)
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    batch.admit(requests)
    # a ring as long as the longest row may grow: prompt 9 + limit 15
    assert (len(batch.rows), batch.columns) == (8, len(PROMPTS[2]) + 15)
    batch.step()
    batch.step()  # six rows end here: their slots are free
    assert len(batch.rows) == 8 and len(batch.live) == 2
    batch.compact_if_sparse()  # no row waits to join them (the decoding thread asks after admitting)
    assert len(batch.rows) == 2 and all(row is not None for row in batch.rows)  # compacted
    assert batch.mask.shape == (2, len(PROMPTS[2]) + 15) and batch.layers[0].keys.shape[0] == 2
    while batch.rows:
        batch.step()
    for index in range(8):
        prompt, seed = PROMPTS[index % 4], 10 + index
        _close(results[(tuple(prompt), seed)], _alone(backend, prompt, seed, 2 if index < 6 else 15))


def test_a_row_joins_a_free_slot_without_copying_the_others(backend):
    """Four rows, two of which end: two new rows take their slots, written in place (the buffers
    are the same tensors), and every row samples what it would alone."""
    results: dict = {}
    first = [_request(PROMPTS[i], 20 + i, 3 if i < 2 else 14, results=results)[0] for i in range(4)]
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    batch.admit(first)
    for _ in range(4):
        batch.step()  # rows 0 and 1 have ended: two free slots
    assert sum(row is None for row in batch.rows) == 2
    buffers = [layer.keys.data_ptr() for layer in batch.layers]
    late = [_request(PROMPTS[1], 30, 9, results=results)[0], _request(PROMPTS[3], 31, 9, results=results)[0]]
    batch.admit(late)
    assert [layer.keys.data_ptr() for layer in batch.layers] == buffers and batch.live == first[2:] + late \
        or sorted(map(id, batch.live)) == sorted(map(id, first[2:] + late))
    while batch.rows:
        batch.step()
    for prompt, seed, limit in [(PROMPTS[0], 20, 3), (PROMPTS[1], 21, 3), (PROMPTS[2], 22, 14), (PROMPTS[3], 23, 14),
                                (PROMPTS[1], 30, 9), (PROMPTS[3], 31, 9)]:
        _close(results[(tuple(prompt), seed)], _alone(backend, prompt, seed, limit))


def test_a_row_that_joins_late_wraps_around_the_ring(backend):
    """A long row, then one that joins 25 steps in: its tokens run past the ring's end and wrap to
    its start (its own slot's columns), and it still samples what it would alone."""
    results: dict = {}
    batch = DecodeBatch(backend.model, backend.device, backend.pad_id)
    batch.admit([_request(PROMPTS[3], 40, 30, results=results)[0]])
    assert batch.columns == 3 + 30
    for _ in range(25):
        batch.step()
    batch.admit([_request(PROMPTS[2], 41, 20, results=results)[0]])  # 9 + 20 <= 33: in place
    assert batch.columns == 33
    while batch.rows:
        batch.step()
    assert batch.end == 0  # cleared once both ended; the late row wrote columns 25..32, then 0..11
    _close(results[(tuple(PROMPTS[3]), 40)], _alone(backend, PROMPTS[3], 40, 30))
    _close(results[(tuple(PROMPTS[2]), 41)], _alone(backend, PROMPTS[2], 41, 20))


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
    assert batch.live == [kept]  # it left its slot
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
    # each row is counted at its largest possible length, prompt + limit: 9 + 12 = 21 for PROMPTS[2]
    tight = DecodeServer(server.new_batch, max_rows=8, max_tokens=2 * (len(PROMPTS[2]) + 12))
    queue = deque([waiting[2], waiting[0], waiting[1]])
    # the first always goes in; the second makes 2 slots x 21 columns = 42 <= 42, a third 63
    assert tight._admissible(batch, queue) == [waiting[2], waiting[0]] and list(queue) == [waiting[1]]
    lone = DecodeServer(server.new_batch, max_rows=8, max_tokens=1)
    assert lone._admissible(batch, deque(waiting)) == waiting[:1]  # into an empty batch, one always


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


# ---------------------------------------------------------------------------- faults


class Flaky(torch.nn.Module):
    """The model, but its forwards raise `error` where `fails(kind, input_ids)` says so (kind:
    "prefill" for a forward of several positions, "decode" for one)."""

    def __init__(self, model, fails, error):
        super().__init__()
        self.model, self.fails, self.error, self.calls = model, fails, error, []

    def forward(self, input_ids, **kwargs):
        kind = "prefill" if input_ids.shape[1] > 1 else "decode"
        self.calls.append((kind, input_ids.shape[0]))
        if self.fails(kind, input_ids):
            raise self.error
        return self.model(input_ids=input_ids, **kwargs)


def _serve(server, requests):
    """Submit (prompt, seed, limit[, after_s]) requests to `server` from an event loop (each after
    `after_s`); their results or errors."""
    async def one(prompt, seed, limit, after_s=0.0):
        await asyncio.sleep(after_s)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        server.submit(DecodeRequest(tuple(prompt), SamplingParams(limit, ()), seed,
                                    lambda r: loop.call_soon_threadsafe(_settle, future, r)))
        try:
            return await asyncio.wait_for(future, 60)
        except RuntimeError as error:
            return error

    async def main():
        return await asyncio.gather(*[one(*request) for request in requests])

    return asyncio.run(main())


def test_running_out_of_memory_retracts_rows_and_fails_none(backend):
    """The third decode forward runs out of memory: the later half of the rows starts again once
    the others have ended, and every row samples what it would alone."""
    decodes = []

    def fails(kind, input_ids):
        decodes.append(kind == "decode")
        return sum(decodes) == 3 and kind == "decode"

    flaky = Flaky(backend.model, fails, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    server = DecodeServer(lambda: DecodeBatch(flaky, backend.device, backend.pad_id))
    requests = [(PROMPTS[i], 50 + i, 6) for i in range(4)]
    try:
        results = _serve(server, requests)
    finally:
        server.close()
    for (prompt, seed, limit), got in zip(requests, results, strict=True):
        _close(got, _alone(backend, prompt, seed, limit))
    prefills = [rows for kind, rows in flaky.calls if kind == "prefill"]
    assert prefills[0] == 4 and sum(prefills[1:]) == 2  # two rows retracted, admitted again


def test_a_failed_prefill_fails_only_the_rows_that_were_joining(backend):
    """A prefill of PROMPTS[2] raises while two rows decode: only its request fails."""
    def fails(kind, input_ids):
        return kind == "prefill" and input_ids.shape[1] == len(PROMPTS[2])

    flaky = Flaky(backend.model, fails, RuntimeError("CUDA error: an illegal memory access"))
    server = DecodeServer(lambda: DecodeBatch(flaky, backend.device, backend.pad_id))
    try:  # the third joins once the first two decode (their prefill is done)
        results = _serve(server, [(PROMPTS[0], 60, 200), (PROMPTS[1], 61, 200), (PROMPTS[2], 62, 4, 0.2)])
    finally:
        server.close()
    _close(results[0], _alone(backend, PROMPTS[0], 60, 200))
    _close(results[1], _alone(backend, PROMPTS[1], 61, 200))
    assert ("prefill", 1) in flaky.calls  # it was prefilled alone, joining
    assert isinstance(results[2], RuntimeError) and str(results[2]) == "CUDA error: an illegal memory access"


def test_a_decoding_thread_that_dies_answers_every_request_and_refuses_the_next(backend):
    """A BaseException the thread does not handle (here from starting a batch): the waiting requests
    are answered with it, and later ones at once, never left hanging."""
    class Lost(BaseException):
        pass

    def new_batch():
        raise Lost("device lost")

    server = DecodeServer(new_batch)
    results = _serve(server, [(PROMPTS[0], 1, 4), (PROMPTS[1], 2, 4)])
    later = _serve(server, [(PROMPTS[2], 3, 4)])
    server.close()
    message = "the torch backend's decoding thread died: Lost: device lost"
    assert [str(result) for result in results + later] == [message] * 3
    assert isinstance(server.broken, Lost)


def test_a_request_submitted_as_the_thread_dies_is_answered(monkeypatch):
    """The race the lock closes: a request checked in while the thread is alive, put in its inbox
    only after the dying thread drained it. Here the submit pauses between the two until the thread
    has had every chance to die; the request must still be answered (with the thread's death)."""
    import threading

    go = threading.Event()

    def new_batch():
        go.wait(5)
        raise RuntimeError("device lost")  # outside a forward: the decoding thread dies

    server = DecodeServer(new_batch)
    first, second = [], []
    server.submit(DecodeRequest(tuple(PROMPTS[0]), SamplingParams(4, ()), 1, first.append))
    original = DecodeServer._ensure_running

    def slow_start(self):  # between the check and the put: the thread dies meanwhile, if it can
        original(self)
        go.set()
        thread = self._thread
        if thread is not None:
            thread.join(2)

    monkeypatch.setattr(DecodeServer, "_ensure_running", slow_start)
    answered = threading.Event()
    submitter = threading.Thread(target=lambda: server.submit(DecodeRequest(
        tuple(PROMPTS[1]), SamplingParams(4, ()), 2, lambda result: (second.append(result), answered.set()))))
    submitter.start()
    submitter.join(10)
    assert answered.wait(10), "a request submitted as the decoding thread died was never answered"
    message = "the torch backend's decoding thread died: RuntimeError: device lost"
    assert [str(result) for result in first + second] == [message, message]
    server.close()


def test_a_request_put_in_the_inbox_as_the_thread_dies_is_answered():
    """The same race, paused at the put itself: the inbox's put waits until the thread has had every
    chance to die. The check-in holds the lock the dying thread takes to record its death, so the
    thread dies only after the put and drains the request; a put outside the lock would land in an
    inbox nobody reads any more."""
    go = threading.Event()

    def new_batch():
        go.wait(5)
        raise RuntimeError("device lost")

    server = DecodeServer(new_batch)
    first, second = [], []
    server.submit(DecodeRequest(tuple(PROMPTS[0]), SamplingParams(4, ()), 1, first.append))
    inbox = server._inbox

    class SlowPut:  # the inbox, whose put pauses until the thread has had every chance to die
        def get(self, block=True):
            return inbox.get(block=block)

        def put(self, item):
            go.set()
            thread = server._thread
            if thread is not None:
                thread.join(1)
            inbox.put(item)

    server._inbox = SlowPut()
    answered = threading.Event()
    submitter = threading.Thread(target=lambda: server.submit(DecodeRequest(
        tuple(PROMPTS[1]), SamplingParams(4, ()), 2, lambda result: (second.append(result), answered.set()))))
    submitter.start()
    submitter.join(10)
    assert answered.wait(10), "a request put in the inbox as the decoding thread died was never answered"
    message = "the torch backend's decoding thread died: RuntimeError: device lost"
    assert [str(result) for result in first + second] == [message, message]
    server.close()
