"""The committed tiny policy (cleaner/assets/tiny-policy) loads and solves toy prompts with the tool."""

from __future__ import annotations

import pytest
import torch

from cleaner.config import DEFAULT_POLICY
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.model.chat import ChatFormat, parse_tool_call

pytestmark = pytest.mark.skipif(not (DEFAULT_POLICY / "model.safetensors").exists(),
                                reason="cleaner/assets/tiny-policy is not committed yet")


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY).eval()
    return model, ChatFormat(AutoTokenizer.from_pretrained(DEFAULT_POLICY))


def test_the_asset_is_the_tiny_qwen3(policy):
    model, chat = policy
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert 400_000 < model.num_parameters() < 520_000 and len(chat.tokenizer) == 512
    assert (DEFAULT_POLICY / "model.safetensors").stat().st_size < 3_000_000


def test_greedy_first_turn_is_a_correct_tool_call(policy):
    from cleaner.toys.local_exec import run_snippets

    model, chat = policy
    tasks = toy_tasks(6, seed=123)
    codes = []
    for task in tasks:
        prompt = torch.tensor([chat.prompt_ids(task.messages)])  # (1, T)
        with torch.no_grad():
            output = model.generate(prompt, max_new_tokens=120, do_sample=False,
                                    eos_token_id=list(chat.stop_token_ids), pad_token_id=chat.tokenizer.pad_token_id)
        generated = output[0, prompt.shape[1]:].tolist()
        assert generated[-1] == chat.tool_call_close_id  # greedy decoding calls the tool
        call = parse_tool_call(chat.decode(generated))
        assert call is not None and call.code is not None
        codes.append(call.code)
    results = run_snippets(codes)
    printed = [r.response.split("stdout: ")[-1].strip() if r.ok else None for r in results]
    correct = sum(p == t.ground_truth for p, t in zip(printed, tasks, strict=True))
    assert correct >= 5, list(zip(codes, printed, [t.ground_truth for t in tasks], strict=True))


@pytest.mark.parametrize("name", ["tiny-policy-env", "tiny-policy-recover"])
def test_the_other_policies_share_the_first_ones_architecture_and_tokenizer(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cleaner.config import ASSETS_DIR

    policy = ASSETS_DIR / name
    model = AutoModelForCausalLM.from_pretrained(policy)
    assert model.config.to_dict() | {"_name_or_path": ""} == (
        AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY).config.to_dict() | {"_name_or_path": ""})
    assert AutoTokenizer.from_pretrained(policy).get_vocab() == AutoTokenizer.from_pretrained(DEFAULT_POLICY).get_vocab()
    assert (policy / "model.safetensors").stat().st_size < 3_000_000
