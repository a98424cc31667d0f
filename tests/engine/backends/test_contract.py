"""The contract every backend passes (base.py's Backend), written once and run on each of them.

- torch: the tiny random Qwen3 on CPU, in CI.
- sglang-engine: an in-process `sglang.Engine` (`-m gpu`, needs sglang; deterministic inference
  on, so seeds are honoured).
- sglang-server: a running server or router (`-m gpu` with CLEANER_SGLANG_URL set, launched with
  --enable-deterministic-inference on CLEANER_SGLANG_MODEL, a checkpoint this machine sees at the
  same path; its `adopt` case writes a perturbed copy under pytest's tmp dir, which the server
  must see too: run it on the server's machine).

Without a GPU the sglang cases are skipped, never faked. The reference for "a naive forward" is
always transformers on CPU in float32, independent of the backend under test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cleaner.engine.backends.base import LENGTH, STOP, Backend, SamplingParams
from cleaner.engine.models import load_policy

PROMPTS = [[1, 5, 9, 13, 2], [3, 4], [7, 7, 7, 8, 9, 10, 11, 12, 20]]


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Backend]  # checkpoint -> a backend serving it
    atol: float  # log-prob tolerance against the CPU float32 reference


def _torch(model_path: Path) -> Backend:
    from cleaner.engine.backends.torch_backend import TorchBackend

    return TorchBackend(model_path)


def _sglang_engine(model_path: Path) -> Backend:
    pytest.importorskip("sglang")
    from cleaner.engine.backends.sglang_backend import SGLangBackend

    return SGLangBackend(model_path, device="cuda", dtype="float32", mem_fraction_static=0.3,
                         enable_deterministic_inference=True)


def _sglang_server(model_path: Path) -> Backend:
    from cleaner.engine.backends.sglang_server import SGLangServerBackend

    return SGLangServerBackend(os.environ["CLEANER_SGLANG_URL"], model_path)


needs_server = pytest.mark.skipif("CLEANER_SGLANG_URL" not in os.environ, reason="CLEANER_SGLANG_URL not set")
CASES = [
    pytest.param(Case(_torch, atol=1e-4), id="torch"),
    pytest.param(Case(_sglang_engine, atol=2e-3), id="sglang-engine", marks=pytest.mark.gpu),
    pytest.param(Case(_sglang_server, atol=2e-3), id="sglang-server", marks=[pytest.mark.gpu, needs_server]),
]


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen3_dir) -> Path:
    return Path(os.environ.get("CLEANER_SGLANG_MODEL", tiny_qwen3_dir))


@pytest.fixture(scope="module", params=CASES)
def served(request, checkpoint):
    torch.set_num_threads(2)
    backend = request.param.make(checkpoint)
    yield backend, request.param.atol
    backend.close()


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_policy(checkpoint, "cpu", torch.float32).eval()


def naive_logprobs(model, tokens: list[int]) -> list[float]:
    """log pi(tokens[t] | tokens[:t]) for t >= 1, by one unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()  # (T, V)
    picked = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1))  # (T-1, 1)
    return picked.squeeze(-1).tolist()


def test_context_length_is_the_checkpoints(served, checkpoint):
    from transformers import AutoConfig

    backend, _ = served
    expected = AutoConfig.from_pretrained(checkpoint).max_position_embeddings
    assert backend.context_length == expected
    assert "CLEANER_SGLANG_MODEL" in os.environ or expected == 512  # tests.helpers.tiny_qwen3


# ---------------------------------------------------------------------------- generate


def test_stop_tokens_are_kept_and_honoured(served):
    backend, _ = served
    greedy = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=0.0)
    reference = backend.generate([PROMPTS[2]], greedy, seeds=[0])[0].token_ids
    stop = reference[2]
    cut = reference.index(stop)  # the first occurrence may come before index 2
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(stop,), temperature=0.0)
    stopped, other = backend.generate([PROMPTS[2], PROMPTS[0]], params, seeds=[0, 0])
    assert stopped.token_ids == reference[: cut + 1]  # ends at the stop token, which is kept
    assert stopped.finish_reason == STOP
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert other.finish_reason == LENGTH or other.token_ids[-1] == stop  # rows stop on their own


@pytest.mark.parametrize("max_new_tokens", [1, 5])
def test_max_new_tokens_is_respected(served, max_new_tokens):
    backend, _ = served
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=())
    for generation in backend.generate(PROMPTS, params, seeds=[1, 2, 3]):
        assert len(generation.token_ids) == len(generation.logprobs) == max_new_tokens
        assert generation.finish_reason == LENGTH


def test_the_same_seed_gives_the_same_tokens(served):
    backend, _ = served
    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    a = backend.generate([PROMPTS[0]] * 3, params, seeds=[11, 11, 12])
    assert a[0].token_ids == a[1].token_ids
    assert a[0].token_ids != a[2].token_ids
    alone = backend.generate([PROMPTS[0]], params, seeds=[11])[0]  # another call, another batch
    assert alone.token_ids == a[0].token_ids


def test_generated_logprobs_equal_scoring_the_tokens_afterwards(served):
    backend, atol = served
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(), temperature=1.0)
    generations = backend.generate(PROMPTS, params, seeds=[3, 4, 5])
    scored = backend.score([p + list(g.token_ids) for p, g in zip(PROMPTS, generations, strict=True)],
                           [len(p) for p in PROMPTS])
    for generation, row in zip(generations, scored, strict=True):
        assert list(generation.logprobs) == pytest.approx(row, abs=atol)


# ---------------------------------------------------------------------------- score


SEQUENCES = [PROMPTS[0] + [4, 4, 6], PROMPTS[0] + [4, 9], PROMPTS[1], PROMPTS[2]]
STARTS = [5, 6, 1, 3]


def test_score_equals_a_naive_forward(served, reference):
    backend, atol = served
    for seq, start, row in zip(SEQUENCES, STARTS, backend.score(SEQUENCES, STARTS), strict=True):
        assert row == pytest.approx(naive_logprobs(reference, seq)[start - 1:], abs=atol)
    assert backend.score([PROMPTS[1]], [2]) == [[]]


def test_the_scorer_equals_score(served):
    backend, atol = served
    scorer = backend.scorer()
    got = scorer.score_rows(SEQUENCES, STARTS)
    for row, expected in zip(got, backend.score(SEQUENCES, STARTS), strict=True):
        assert row == pytest.approx(expected, abs=atol)
    assert scorer.stats.tokens_naive == sum(len(s) for s in SEQUENCES)


# ---------------------------------------------------------------------------- new weights


def test_adopting_new_weights_changes_the_policy(served, checkpoint, tmp_path_factory):
    backend, atol = served
    halved = load_policy(checkpoint, "cpu", torch.float32)
    halved.load_state_dict({k: v * 0.5 for k, v in halved.state_dict().items()})
    new = tmp_path_factory.mktemp("adopted") / f"{checkpoint.name}-halved"
    halved.save_pretrained(new)
    before, old_rows = backend.policy_version, backend.score(SEQUENCES, STARTS)
    backend.adopt(new)
    try:
        assert backend.model_path == new and backend.policy_version != before
        assert backend.policy_version.startswith(f"{new.name}@")
        rows = backend.score(SEQUENCES, STARTS)
        assert rows[0] != pytest.approx(old_rows[0], abs=1e-3)
        for seq, start, row in zip(SEQUENCES, STARTS, rows, strict=True):
            assert row == pytest.approx(naive_logprobs(halved.eval(), seq)[start - 1:], abs=atol)
    finally:
        backend.adopt(checkpoint)  # the module's other cases share this backend
    assert backend.policy_version == before
