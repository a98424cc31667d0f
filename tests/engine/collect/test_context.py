"""Prompts and response budgets against the model's context (docs/architecture.md §5).

The tiny policy attends over 1,024 positions. With the default budget of 768 response tokens, the
longest prompt that fits is 1,024 - 768 = 256 tokens. Its chat template takes 36 tokens around the
user's text, and digits are single tokens, so a problem of k digits is a prompt of 36 + k tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import GPT2Config, Qwen3Config
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY, CollectConfig, EvalConfig
from cleaner.engine.collect.context import ContextError, fit_prompts
from cleaner.engine.collect.job import CollectRequest, collect_job
from cleaner.engine.collect.tasks import Task
from cleaner.engine.eval.job import eval_job
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import context_length
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse

runner = CliRunner()
TEMPLATE_TOKENS = 36  # the tiny policy's chat template around the user's text
FITS = 1024 - 768  # the longest prompt that leaves the default budget


@pytest.fixture(scope="module")
def backend():
    return TorchBackend(DEFAULT_POLICY)


def digits_file(path: Path, prompt_tokens: list[int]) -> Path:
    """A verl-layout file whose row i is a problem of digits, a prompt of prompt_tokens[i] tokens."""
    rows = [{"prompt": [{"role": "user", "content": "7" * (n - TEMPLATE_TOKENS)}],
             "reward_model": {"ground_truth": "1"}, "data_source": "digits"} for n in prompt_tokens]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def context_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "cleaner.engine.collect.context"]


SMALL = ["--prompt-style", "bare", "--group-size", "1", "--max-turns", "1", "--max-new-tokens", "8",
         "--sandbox-workers", "1"]


def test_the_tiny_policy_attends_over_1024_positions(backend):
    assert backend.context_length == 1024
    prompt = ChatFormat(backend.tokenizer).prompt_ids([{"role": "user", "content": "7" * (FITS - TEMPLATE_TOKENS)}])
    assert len(prompt) == FITS


def test_context_length_reads_the_config():
    assert context_length(Qwen3Config(max_position_embeddings=4096)) == 4096
    assert context_length(GPT2Config(n_positions=512)) == 512


# ---------------------------------------------------------------------------------------------
# collect and run: an error naming the row, or --truncate-prompts


def test_a_prompt_longer_than_the_context_allows_is_an_error_naming_its_row(tmp_path):
    data = digits_file(tmp_path / "long.parquet", [40, FITS, FITS + 1, 5000])
    warehouse = tmp_path / "wh"
    result = runner.invoke(app, ["collect", "-w", str(warehouse), "--data", str(data), "--prompts", "4", *SMALL])
    assert result.exit_code == 1
    assert result.output.replace("\n", "").endswith(  # after transformers' progress bar
        f"error: {data}: row 2 (prompt digits-2): the prompt is 257 tokens; with max_response_tokens 768 it "
        f"needs 1,025 positions, but model {DEFAULT_POLICY} has 1,024 (2 of 4 prompts do not fit): shorten "
        "them, lower --max-response-tokens, or pass --truncate-prompts to keep each prompt's last 256 tokens")
    assert Warehouse(warehouse).rollout_ids(0) == frozenset()  # nothing generated, nothing stored


def test_a_budget_the_context_cannot_hold_is_an_error(tmp_path):
    data = digits_file(tmp_path / "short.parquet", [40])
    result = runner.invoke(app, ["collect", "-w", str(tmp_path / "wh"), "--data", str(data), "--prompts", "1",
                                 "--max-response-tokens", "1024", *SMALL])
    assert result.exit_code == 1
    assert result.output.replace("\n", "").endswith(
        f"error: max_response_tokens 1,024 leaves no room for a prompt in model {DEFAULT_POLICY}'s context of "
        "1,024 tokens; lower --max-response-tokens")


def test_truncate_prompts_keeps_each_long_prompts_last_tokens(tmp_path, backend, caplog):
    data = digits_file(tmp_path / "long.parquet", [40, FITS, FITS + 1, 5000])
    warehouse = Warehouse(tmp_path / "wh")
    config = CollectConfig(data=str(data), prompt_style="bare", n_prompts=4, group_size=1, max_turns=1,
                           max_new_tokens=8, truncate_prompts=True, sandbox=SandboxConfig(workers=1))
    with caplog.at_level(logging.WARNING, logger="cleaner.engine.collect.context"):
        collect_job(warehouse, CollectRequest(config), backend=backend, progress=False)
    assert context_warnings(caplog) == [
        f"--truncate-prompts: 2 of 4 prompts kept only their last 256 tokens (the longest had 5000), so that "
        f"each fits model {DEFAULT_POLICY}'s context of 1024 tokens with the response budget of 768"]
    chat = ChatFormat(backend.tokenizer)
    full = chat.prompt_ids([{"role": "user", "content": "7" * (5000 - TEMPLATE_TOKENS)}])
    prompts = {s.rollout_id: s.token_ids for s in warehouse.read_segments(0) if s.kind == "prompt"}
    assert {rid: len(ids) for rid, ids in prompts.items()} == {
        "it0-digits-0-s0": 40, "it0-digits-1-s0": FITS, "it0-digits-2-s0": FITS, "it0-digits-3-s0": FITS}
    assert prompts["it0-digits-3-s0"] == tuple(full[-FITS:])  # the end, with `<|im_start|>assistant\n`
    assert chat.decode(prompts["it0-digits-3-s0"]).endswith("7<|im_end|>\n<|im_start|>assistant\n")


def test_run_takes_truncate_prompts_into_the_collect_config():
    result = runner.invoke(app, ["run", "--truncate-prompts", "--print-config"])
    assert result.exit_code == 0, result.output
    collect_table = result.output.split("[collect]")[1].split("\n[")[0]
    assert "truncate_prompts = true" in collect_table.splitlines()
    default = runner.invoke(app, ["run", "--print-config"]).output
    assert "truncate_prompts = false" in default.split("[collect]")[1].split("\n[")[0].splitlines()


# ---------------------------------------------------------------------------------------------
# eval: a warning, and generations stop at the context's end


def test_eval_warns_when_its_budget_exceeds_the_context_and_stops_there(tmp_path, backend, caplog):
    data = tmp_path / "aime.parquet"
    problems = ["What is (123 * 456 + 789) mod 97?", "Compute (321 * 654 + 987) mod 89."]
    pq.write_table(pa.Table.from_pylist([{"Problem": p, "Answer": 1, "data_source": "AIME2024"} for p in problems]),
                   data)
    config = EvalConfig(datasets=(("toy", str(data)),), n=1, prompt_style="bare", max_turns=2,
                        sandbox=SandboxConfig(workers=1))  # the reference's 20,480-token budget
    assert config.max_response_tokens == 20480
    with caplog.at_level(logging.WARNING, logger="cleaner.engine.collect.context"):
        (row,) = eval_job(Warehouse(tmp_path / "wh"), config, backends={str(DEFAULT_POLICY): backend},
                          progress=False).rows
    chat = ChatFormat(backend.tokenizer)
    longest = max(len(chat.prompt_ids([{"role": "user", "content": p}])) for p in problems)
    assert context_warnings(caplog) == [
        f"the response budget of 20480 tokens exceeds what model {DEFAULT_POLICY}'s context of 1024 tokens "
        f"leaves after 2 of 2 prompts (the longest is {longest} tokens): their generations stop at the "
        "context's end"]
    segments = Warehouse(tmp_path / "wh").read_eval_segments(row.eval_id)
    by_rollout: dict[str, int] = {}
    for segment in segments:
        by_rollout[segment.rollout_id] = by_rollout.get(segment.rollout_id, 0) + len(segment.token_ids)
    assert len(by_rollout) == 2 and max(by_rollout.values()) <= 1024


# ---------------------------------------------------------------------------------------------
# fit_prompts by hand: a context of 100 positions, a budget of 60, so prompts of up to 40 tokens


def _fit(lengths: list[int], strict: bool = True, **config_fields):
    tasks = [Task(f"p-{i}", (), "1", "math", source_row=i) for i in range(len(lengths))]
    prompts = [list(range(n)) for n in lengths]
    config = CollectConfig(data="d.parquet", max_new_tokens=10, max_response_tokens=60, **config_fields)
    return fit_prompts(tasks, prompts, config, 100, strict=strict)


def test_fit_prompts_by_hand(caplog):
    assert _fit([1, 40]) == [[0], list(range(40))]
    with pytest.raises(ContextError, match=r"^/\S*/d.parquet: row 1 \(prompt p-1\): the prompt is 41 tokens; .* "
                                           r"needs 101 positions, .* has 100 \(1 of 2 prompts do not fit\)"):
        _fit([40, 41])
    assert _fit([40, 41, 45], truncate_prompts=True) == [list(range(40)), list(range(1, 41)), list(range(5, 45))]
    with caplog.at_level(logging.WARNING):
        assert _fit([39, 99], strict=False) == [list(range(39)), list(range(99))]
    assert "after 1 of 2 prompts (the longest is 99 tokens)" in caplog.text
    with pytest.raises(ContextError, match=r"row 1 \(prompt p-1\): the prompt is 100 tokens, .* no room"):
        _fit([39, 100], strict=False)
    tasks, prompts = [Task("toy-0", (), "1", "toy")], [list(range(50))]
    with pytest.raises(ContextError, match=r"^prompt toy-0: the prompt is 50 tokens"):  # no file row to name
        fit_prompts(tasks, prompts, CollectConfig(max_new_tokens=10, max_response_tokens=60), 100)
    assert fit_prompts(tasks, prompts, CollectConfig(), None) == prompts  # a backend that does not know
