"""SGLang's request and response shapes (sglang_wire.py), against the shapes in SGLang's source:
GenerateReqInput fields, meta_info's (logprob, token_id, text) entries with a None first input
entry, finish_reason dicts, batch answers as lists, error bodies, the routers' worker lists."""

from __future__ import annotations

import pytest

from cleaner.engine.model.answers import BadAnswer
from cleaner.engine.model.base import LENGTH, STOP, SamplingParams
from cleaner.engine.model.sglang_wire import (
    EngineError,
    batch_body,
    check_answer,
    computed_tokens,
    error_message,
    generate_body,
    generation_from_response,
    input_logprobs_from_response,
    responses_of,
    sampling_params_dict,
    score_body,
    served_model,
    update_weights_body,
    worker_urls,
)

# ---------------------------------------------------------------------------- requests


def test_sampling_params_dict_stops_only_on_our_ids():
    params = SamplingParams(max_new_tokens=7, stop_token_ids=(3, 9), temperature=0.0, top_p=0.9)
    # no ignore_eos: SGLang's finish check returns before reading stop_token_ids when it is set
    assert sampling_params_dict(params, seed=42) == {
        "max_new_tokens": 7, "stop_token_ids": [3, 9], "temperature": 0.0, "top_p": 0.9,
        "sampling_seed": 42,
    }


def test_seeds_fit_the_routers_u64_and_the_servers_i64():
    params = SamplingParams(max_new_tokens=1, stop_token_ids=())
    assert sampling_params_dict(params, seed=-1)["sampling_seed"] == 2**63 - 1
    assert sampling_params_dict(params, seed=2**63 + 5)["sampling_seed"] == 5


def test_generate_body_is_one_request_with_output_logprobs():
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(2,), temperature=1.0)
    assert generate_body([5, 6, 7], params, seed=3) == {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [2], "temperature": 1.0,
                            "top_p": 1.0, "sampling_seed": 3},
        "return_logprob": True, "logprob_start_len": 2, "stream": False,
    }


def test_score_body_asks_prefill_only_from_the_token_before_the_start():
    assert score_body([5, 6, 7, 8], start=2) == {
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 1, "stream": False,
    }


def test_batch_body_lists_every_per_request_field():
    first, second = score_body([1, 2, 3], 1), score_body([4, 5], 2)
    assert batch_body([first, second]) == {
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 0}],
        "return_logprob": [True, True], "logprob_start_len": [0, 1], "stream": False,
    }


def test_update_weights_body_carries_only_what_every_version_accepts(tmp_path):
    assert update_weights_body(tmp_path / "ckpt") == {"model_path": str(tmp_path / "ckpt")}


# ---------------------------------------------------------------------------- responses


def _response(output, finish, inputs=None):
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(output),
            "cached_tokens": 0, "output_token_logprobs": output}
    if inputs is not None:
        meta["input_token_logprobs"] = inputs
    return {"text": "", "output_ids": [entry[1] for entry in output], "meta_info": meta}


def test_generation_from_response_reads_ids_and_finish_reason():
    stopped = _response([[-0.5, 4, None], [-1.25, 9, None]], {"type": "stop", "matched": 9})
    generation = generation_from_response(stopped, 8)
    assert generation.token_ids == (4, 9) and generation.logprobs == (-0.5, -1.25)
    assert generation.finish_reason == STOP
    full = _response([[-0.1, 1, None]] * 3, {"type": "length", "length": 3})
    assert generation_from_response(full, 3).finish_reason == LENGTH
    with pytest.raises(RuntimeError, match="aborted"):
        generation_from_response(_response([], {"type": "abort", "message": "Aborted",
                                                 "status_code": None, "err_type": None}), 8)


def test_a_model_eos_outside_our_stop_ids_still_ends_as_a_stop_and_is_kept():
    eos = _response([[-0.5, 4, None], [-0.2, 63, "<eos>"]], {"type": "stop", "matched": 63})
    generation = generation_from_response(eos, 8)
    assert generation.token_ids == (4, 63) and generation.finish_reason == STOP


def test_a_null_output_logprob_is_an_error():
    with pytest.raises(BadAnswer, match="null output log-prob"):
        generation_from_response(_response([[None, 4, None]], {"type": "length", "length": 1}), 8)


@pytest.mark.parametrize(("output", "finish", "limit", "why"), [
    ([[-0.5, 64, None]], {"type": "length", "length": 1}, 8, "outside the vocabulary"),  # id == vocab size
    ([[-0.5, -1, None]], {"type": "length", "length": 1}, 8, "outside the vocabulary"),
    ([[float("nan"), 4, None]], {"type": "length", "length": 1}, 8, "not a finite number"),
    ([[float("-inf"), 4, None]], {"type": "length", "length": 1}, 8, "not a finite number"),
    ([[0.25, 4, None]], {"type": "length", "length": 1}, 8, "not a finite number <= 0"),  # a probability above 1
    ([], {"type": "length", "length": 0}, 8, "no token generated"),
    ([], {"type": "stop", "matched": 9}, 8, "no token generated"),
    ([[-0.5, 4, None]] * 3, {"type": "length", "length": 3}, 2, "at most 2"),
    ([[-0.5, 4, None], ["x", 4, None]], {"type": "length", "length": 2}, 8, "cannot be read"),
])
def test_an_answer_no_policy_gives_is_a_bad_answer(output, finish, limit, why):
    with pytest.raises(BadAnswer, match=why):
        generation_from_response(_response(output, finish), limit, vocab_size=64)


def test_the_length_the_engine_reports_must_be_the_ids_it_sends():
    response = _response([[-0.5, 4, None], [-0.5, 5, None]], {"type": "length", "length": 2})
    response["meta_info"]["completion_tokens"] = 3
    with pytest.raises(BadAnswer, match="reports 3 generated tokens but sent 2"):
        generation_from_response(response, 8, vocab_size=64)
    response["meta_info"]["completion_tokens"] = 0  # a count of none is a count: it is not the 2 sent
    with pytest.raises(BadAnswer, match="reports 0 generated tokens but sent 2"):
        generation_from_response(response, 8, vocab_size=64)
    response["meta_info"]["completion_tokens"] = 2
    assert generation_from_response(response, 8, vocab_size=64).token_ids == (4, 5)


def test_log_probs_at_zero_within_rounding_are_a_policys():
    near = _response([[0.0, 63, None], [4e-4, 1, None]], {"type": "length", "length": 2})
    assert generation_from_response(near, 8, vocab_size=64).logprobs == (0.0, 4e-4)


def test_check_answer_reads_a_score_request_by_its_body():
    body = score_body([5, 6, 7], start=1)
    good = {"meta_info": {"input_token_logprobs": [(None, 5, None), (-0.3, 6, None), (-0.7, 7, None)]}}
    check_answer(body, good, vocab_size=64)
    for value in (float("nan"), 0.5):
        bad = {"meta_info": {"input_token_logprobs": [(None, 5, None), (value, 6, None), (-0.7, 7, None)]}}
        with pytest.raises(BadAnswer, match="not a finite number"):
            check_answer(body, bad, vocab_size=64)
    generate = generate_body([5, 6], SamplingParams(max_new_tokens=2, stop_token_ids=()), seed=1)
    with pytest.raises(BadAnswer, match="outside the vocabulary"):
        check_answer(generate, _response([[-0.1, 70, None]], {"type": "length", "length": 1}), vocab_size=64)


def test_input_logprobs_take_the_tail_and_check_ids():
    sequence = [5, 6, 7, 8]
    # asked with logprob_start_len = start - 1 = 1: entry for position 1 is the None placeholder
    output = {"meta_info": {"input_token_logprobs": [(None, 6, None), (-0.3, 7, None), (-0.7, 8, None)]}}
    assert input_logprobs_from_response(output, sequence, start=2) == [-0.3, -0.7]
    assert input_logprobs_from_response(output, sequence, start=4) == []
    with pytest.raises(BadAnswer, match="do not line up"):
        input_logprobs_from_response(output, [5, 6, 7, 9], start=2)
    with pytest.raises(BadAnswer, match="do not line up"):
        input_logprobs_from_response(output, sequence, start=1)  # would need the None entry


def test_the_last_vocabulary_id_may_come_back_as_zero():
    # SGLang 0.5.23 answered [1, 2, 3, 511, 5] (vocab 512), logprob_start_len 0, with these ids;
    # the log-prob at 511's place was 511's (transformers: -13.0979)
    output = {"meta_info": {"input_token_logprobs": [(None, 1, None), (-7.8232, 2, None), (-11.6111, 3, None),
                                                     (-13.0979, 0, None), (-11.0352, 5, None)]}}
    assert input_logprobs_from_response(output, [1, 2, 3, 511, 5], 1, vocab_size=512) == [
        -7.8232, -11.6111, -13.0979, -11.0352]
    with pytest.raises(BadAnswer, match="do not line up"):
        input_logprobs_from_response(output, [1, 2, 3, 511, 5], 1)  # without the vocab size: strict
    with pytest.raises(BadAnswer, match="do not line up"):
        input_logprobs_from_response(output, [1, 2, 3, 510, 5], 1, vocab_size=512)  # only the last id


def test_the_wire_cheat_sheet_response():
    # prompt [1, 2, 3], logprob_start_len 1: [null, 2], [-3.1, 3]; then two generated tokens
    response = _response([[-0.2, 17, None], [-0.01, 2, None]], {"type": "stop", "matched": 2},
                         inputs=[[None, 2, None], [-3.1, 3, None]])
    assert input_logprobs_from_response(response, [1, 2, 3], start=2) == [-3.1]
    assert generation_from_response(response, 8).token_ids == (17, 2)


def test_responses_of_takes_one_object_or_a_batch_list():
    one = _response([[-0.1, 1, None]], {"type": "length", "length": 1})
    assert responses_of(one, 1) == [one]
    assert responses_of([one, one], 2) == [one, one]
    with pytest.raises(EngineError, match="2 responses to 3 requests"):
        responses_of([one, one], 3)
    with pytest.raises(EngineError, match="without meta_info"):
        responses_of({"error": {"message": "bad"}}, 1)


def test_computed_tokens_are_the_prompt_past_the_cached_prefix():
    # SGLang 0.5.23's meta_info of a scoring request whose first 4 tokens were in its radix cache
    scored = {"meta_info": {"prompt_tokens": 7, "completion_tokens": 0, "cached_tokens": 4,
                            "cached_tokens_details": {"device": 4, "host": 0}}}
    assert computed_tokens(scored) == 3
    assert computed_tokens({"meta_info": {"prompt_tokens": 5}}) == 5  # a version without the field


def test_error_messages_of_the_servers_bodies():
    assert error_message({"error": {"message": "logprob_start_len too large"}}) == "logprob_start_len too large"
    assert error_message({"error": "unknown field `seed`"}) == "unknown field `seed`"
    assert error_message({"detail": "Not Found"}) == "Not Found"
    assert error_message("Cache flushed.\n") == "Cache flushed.\n"


def test_worker_urls_of_both_routers():
    gateway = {"workers": [{"id": "a", "url": "http://w1:31000/"}, {"id": "b", "url": "http://w2:31250"}],
               "total": 2, "stats": {}}
    assert worker_urls(gateway) == ["http://w1:31000", "http://w2:31250"]
    assert worker_urls({"urls": ["http://w1:31000"]}) == ["http://w1:31000"]
    # sglang-router 0.3.2 answers its health check before it has registered its workers
    assert worker_urls({"workers": [], "total": 0, "stats": {}}) == []
    assert worker_urls({"detail": "Not Found"}) is None  # not a router


def test_served_model_is_normalised():
    assert served_model({"model_path": "/ckpt/iteration-1/", "is_generation": True}) == "/ckpt/iteration-1"
    assert served_model("text") is None
