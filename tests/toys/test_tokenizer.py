"""The tiny tokenizer: digits one per token, special tokens whole, the expected chat template."""

from __future__ import annotations

import pytest

from cleaner.engine.model.chat import ChatFormat
from cleaner.tools.responses import TOOL_SCHEMA
from cleaner.toys.corpus import CorpusConfig, build_corpus
from cleaner.toys.sft import corpus_texts
from cleaner.toys.tokenizer import SPECIAL_TOKENS, build_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(CorpusConfig(size=200, seed=1))


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return build_tokenizer(corpus_texts(corpus))


def test_vocabulary_is_512_with_every_special_token(tokenizer):
    assert len(tokenizer) == 512
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.decode(ids) == token
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"


def test_digits_are_split_one_per_token(tokenizer):
    ids = tokenizer.encode("print(1234 % 56)", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == ["1", "2", "3", "4", "5", "6"]
    assert tokenizer.decode(ids) == "print(1234 % 56)"


def test_chat_template_renders_system_line_user_and_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], add_generation_prompt=True,
                                         tokenize=False)
    assert text == ("<|im_start|>system\nYou solve problems with a Python tool.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "S"}] + messages
    assert tokenizer.apply_chat_template(own_system, tokenize=False).startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user")


def test_segmentwise_encoding_equals_whole_encoding(tokenizer, corpus):
    chat = ChatFormat(tokenizer)
    for example in corpus[:50]:
        texts = [t for pair in zip(example.assistant_texts, example.tool_texts + ("",), strict=True) for t in pair]
        pieces = [i for text in texts for i in chat.encode(text)]
        assert pieces == chat.encode("".join(texts))
