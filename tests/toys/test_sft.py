"""Supervised bootstrap: masks, the constant-normalised loss, the schedule, an end-to-end tiny run."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.engine.model.chat import ChatFormat
from cleaner.toys.corpus import TYPO, CorpusConfig, build_corpus
from cleaner.toys.sft import (
    BootstrapConfig,
    corpus_texts,
    encode_example,
    lr_at,
    summed_token_loss,
)
from cleaner.toys.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def chat_and_corpus():
    corpus = build_corpus(CorpusConfig(size=60, seed=2, fail_share=0.5))
    return ChatFormat(build_tokenizer(corpus_texts(corpus))), corpus


def test_only_assistant_tokens_are_trained(chat_and_corpus):
    chat, corpus = chat_and_corpus
    example = next(e for e in corpus if e.failure == TYPO)
    encoded = encode_example(example, chat)
    prompt = chat.prompt_ids(example.task.messages)
    assert list(encoded.token_ids[: len(prompt)]) == prompt and not any(encoded.loss_mask[: len(prompt)])
    trained = [t for t, m in zip(encoded.token_ids, encoded.loss_mask, strict=True) if m]
    assert chat.decode(trained) == "".join(example.assistant_texts)
    untrained_after_prompt = [t for t, m in list(zip(encoded.token_ids, encoded.loss_mask, strict=True))[len(prompt):] if not m]
    assert chat.decode(untrained_after_prompt) == "".join(example.tool_texts)


def test_summed_loss_matches_hand_computation():
    logits = torch.zeros(1, 3, 2)  # (B, T, V): uniform -> each token costs log 2
    logits[0, 1] = torch.tensor([0.0, math.log(3.0)])  # p(token 1 | x_<2) = 3/4
    input_ids = torch.tensor([[0, 1, 1]])
    loss_mask = torch.tensor([[0.0, 1.0, 1.0]])
    expected = math.log(2.0) + -math.log(0.75)  # position 1 under logits[0], position 2 under logits[1]
    assert summed_token_loss(logits, input_ids, loss_mask).item() == pytest.approx(expected, rel=1e-6)
    loss_mask = torch.tensor([[0.0, 0.0, 1.0]])
    assert summed_token_loss(logits, input_ids, loss_mask).item() == pytest.approx(-math.log(0.75), rel=1e-6)


def test_learning_rate_schedule():
    config = BootstrapConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(1e-4)
    assert lr_at(9, config) == pytest.approx(1e-3)
    assert lr_at(60, config) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, config) == pytest.approx(1e-4)


def test_bootstrap_cli_writes_a_loadable_policy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "policy"
    result = CliRunner().invoke(app, ["bootstrap", "--out", str(out), "--steps", "2", "--corpus-size", "24",
                                      "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no temporary dirs left
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (128, 2, 512)
    assert model.config.tie_word_embeddings and 400_000 < model.num_parameters() < 520_000
    chat = ChatFormat(tokenizer)
    prompt = torch.tensor([chat.prompt_ids([{"role": "user", "content": "What is 1 + 1?"}])])
    output = model.generate(prompt, max_new_tokens=3, do_sample=False, eos_token_id=list(chat.stop_token_ids))
    assert output.shape[1] > prompt.shape[1]


def test_bootstrap_cli_rejects_a_bad_fail_share(tmp_path):
    result = CliRunner().invoke(app, ["bootstrap", "--out", str(tmp_path / "p"), "--fail-share", "2"])
    assert result.exit_code == 1 and "invalid option: --fail-share must be in [0, 1], got 2.0" in result.output


def test_calibration_stage_continues_from_a_policy_with_its_tokenizer(tmp_path):
    import json

    from safetensors.torch import load_file

    base, tuned = tmp_path / "base", tmp_path / "tuned"
    common = ["--steps", "1", "--corpus-size", "16", "--batch-size", "4"]
    assert CliRunner().invoke(app, ["bootstrap", "--out", str(base), *common]).exit_code == 0
    result = CliRunner().invoke(app, ["bootstrap", "--out", str(tuned), "--init-from", str(base),
                                      "--fail-share", "0.9", "--lr", "1e-3", *common])
    assert result.exit_code == 0, result.output
    assert (tuned / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    recorded = json.loads((tuned / "bootstrap_config.json").read_text())
    assert recorded["init_from"] == str(base) and recorded["corpus"]["fail_share"] == 0.9
    before, after = load_file(base / "model.safetensors"), load_file(tuned / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and max((before[n] - after[n]).abs().max().item() for n in changed) < 0.01  # one small step
