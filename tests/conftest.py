"""Shared fixtures. GPU tests are skipped, never faked, where CUDA is absent."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A saved random tiny Qwen3 (vocab 64, no tokenizer); tests must not write into it."""
    from tests.helpers import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_policy(tmp_path_factory):
    """A random-weight tiny Qwen3 with the real tiny-policy tokenizer, saved as an HF directory.

    Independent of the trained asset and fast to build; it rarely closes a tool call, so rollouts
    run to their token limits. Use it for plumbing (run loop, resume, crash safety).
    """
    from cleaner.engine.bootstrap.sft import tiny_model
    from cleaner.engine.bootstrap.tokenizer import build_tokenizer
    from cleaner.engine.chat import format_call, format_tool_response, tool_response_text
    from cleaner.engine.collect.tasks import toy_tasks

    texts = []
    for task in toy_tasks(64, seed=1):
        texts.append(task.messages[-1]["content"])
        texts.append(format_call(f"print(({task.ground_truth} * 3 + 1) % 7)"))
        texts.append(tool_response_text(format_tool_response(True, task.ground_truth, "")))
    tokenizer = build_tokenizer(texts)
    path = tmp_path_factory.mktemp("random-policy")
    tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
