"""Bring your own task (docs/byo-task.md) through the commands: a verl reward file and a second tool
on `collect`, `eval` and `run`, with the committed tiny policy, the real sandbox and the example
of examples/units; the warehouse's reward_details and tool_name columns in SQL and in `cleaner ui`.

The rewards are checked against an oracle outside the agent loop: the stored segments rendered in
the rollout's view, decoded without special tokens, handed to the reward file's own function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.saar.walk import render, view_for
from cleaner.plugins import load_object
from cleaner.ui.app import create_app
from cleaner.warehouse import Warehouse
from cleaner.warehouse.browse import Browser
from tests.agent_fakes import BASE, run_units

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
REWARD = f"{EXAMPLE}/reward.py:compute_score"
TOOLS = str(EXAMPLE / "tools.yaml")
TINY = ["--prompt-style", "bare", "--top-p", "1.0", "--max-new-tokens", "160", "--max-response-tokens", "768",
        "--sandbox-workers", "1"]


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("units") / "units.parquet"
    rows = load_object(f"{EXAMPLE}/make_data.py:rows", "example")(6, 0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def oracle(rollouts, segments, extra_infos: dict[str, dict], collect_view: str, config: CollectConfig):
    """{rollout_id: compute_score(...)} computed from the stored rows alone."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
    score = load_object(REWARD, "reward")
    expected = {}
    for rollout in rollouts:
        mine = sorted((s for s in segments if s.rollout_id == rollout.rollout_id), key=lambda s: s.seq)
        view = view_for(rollout.rollback_draw, collect_view == "purified", config)
        rendered = render(mine, view)
        solution = tokenizer.decode(list(rendered.token_ids[rendered.prompt_len:]), skip_special_tokens=True)
        extra = {**extra_infos[rollout.prompt_id], "num_turns": len(mine), "rollout_reward_scores": {}, "tool_rewards": []}
        expected[rollout.rollout_id] = score(data_source=rollout.data_source, solution_str=solution,
                                            ground_truth=rollout.ground_truth, extra_info=extra)
    return expected


def stored(rollouts) -> dict:
    return {r.rollout_id: {"score": r.reward, **json.loads(r.reward_details)} for r in rollouts}


def extra_infos(units: Path) -> dict[str, dict]:
    import pyarrow.parquet as pq

    return {f"units-{row['extra_info']['index']}": row["extra_info"] for row in pq.read_table(units).to_pylist()}


def test_collect_and_eval_reward_with_the_file_as_verl_would(tmp_path, units):
    warehouse = tmp_path / "wh"
    common = ["--reward-fn", REWARD, "--tools", TOOLS, *TINY]
    result = runner.invoke(app, ["collect", "-w", str(warehouse), "--data", str(units), "--prompts", "6",
                                 "--group-size", "2", *common])
    assert result.exit_code == 0, result.output
    wh = Warehouse(warehouse)
    rollouts, segments = wh.read_rollouts(0), wh.read_segments(0)
    assert len(rollouts) == 12
    config = CollectConfig.from_json(wh.collect_config(0))
    assert (config.reward_fn, config.tools) == (REWARD, TOOLS)
    assert stored(rollouts) == oracle(rollouts, segments, extra_infos(units), "purified", config)
    assert {r.correct for r in rollouts} <= {False, True} and all(r.reward_details for r in rollouts)

    # queryable: the details' keys with DuckDB's JSON operators, the call's tool by name
    sql = runner.invoke(app, ["sql", "-w", str(warehouse), "--format", "json",
                              "SELECT rollout_id, reward_details->>'$.pred' AS pred, answer FROM rollouts"])
    assert sql.exit_code == 0, sql.output
    assert all(row["pred"] == row["answer"] for row in json.loads(sql.stdout))

    result = runner.invoke(app, ["eval", "-w", str(warehouse), "--model", str(DEFAULT_POLICY), "--dataset",
                                 f"units={units}", "--n", "2", "--no-saar", *common])
    assert result.exit_code == 0, result.output
    with wh.connect() as connection:
        (eval_id,) = [row[0] for row in connection.sql("SELECT eval_id FROM eval_runs").fetchall()]
    eval_rollouts, eval_segments = wh.read_eval_rollouts(eval_id), wh.read_eval_segments(eval_id)
    eval_config = CollectConfig.from_json(wh.eval_config(eval_id))
    assert eval_config.reward_fn == REWARD
    assert stored(eval_rollouts) == oracle(eval_rollouts, eval_segments, extra_infos(units), "raw", eval_config)


def test_a_reward_function_that_will_not_load_stops_collect_before_the_model(tmp_path, units):
    bad = tmp_path / "reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1 +\n")
    result = runner.invoke(app, ["collect", "-w", str(tmp_path / "wh"), "--data", str(units), "--reward-fn",
                                 str(bad), *TINY])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: reward function '{bad}:compute_score': importing {bad} failed (line 2): "
                                    "SyntaxError")
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "wh" / "rollouts").exists()


def test_a_raising_reward_function_is_one_line_and_resume_finishes_the_iteration(tmp_path, units):
    path = tmp_path / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    if extra_info['index'] == 2:\n"
                    "        raise KeyError('gold')\n"
                    "    return 0.5\n")
    args = ["collect", "-w", str(tmp_path / "wh"), "--data", str(units), "--prompts", "4", "--group-size", "2",
            "--reward-fn", str(path), "--batch-rollouts", "1", "--max-concurrent-rollouts", "1", *TINY]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: reward function compute_score ({path}:compute_score) raised on rollout it0-units-2-s0: "
                      "KeyError: 'gold'"]
    assert "Traceback" not in result.output
    # one at a time, so the rollouts of prompts 0 and 1 were committed before prompt 2's first
    assert sorted(r.rollout_id for r in Warehouse(tmp_path / "wh").read_rollouts(0)) == [
        "it0-units-0-s0", "it0-units-0-s1", "it0-units-1-s0", "it0-units-1-s1"]
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.5\n")
    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert [r.reward for r in Warehouse(tmp_path / "wh").read_rollouts(0)] == [0.5] * 8


def test_the_example_runs_end_to_end_with_both_flags(tmp_path, units):
    """examples/units as docs/byo-task.md runs it: `cleaner run` with the reward file, the YAML and a
    function tool, one iteration on the tiny policy (which never learned the unit tool: the run
    proves the plumbing, not the policy)."""
    result = runner.invoke(app, ["run", "--run-dir", str(tmp_path / "run"), "--data", str(units), "--prompts", "4",
                                 "--group-size", "2", "--iterations", "1", "--reward-fn", REWARD, "--tools", TOOLS,
                                 "--tool", f"{EXAMPLE}/tools.py:unit_factor", *TINY])
    assert result.exit_code == 0, result.output
    wh = Warehouse(tmp_path / "run" / "warehouse")
    assert len(wh.read_rollouts(0)) == 8 and (tmp_path / "run" / "checkpoints" / "iteration-1").is_dir()
    saved = json.loads(wh.collect_config(0))
    assert (saved["reward_fn"], saved["tools"], saved["tool"]) == (REWARD, TOOLS, f"{EXAMPLE}/tools.py:unit_factor")


def test_tool_names_in_sql_and_in_the_browser(tmp_path):
    rollouts, segments, _ = run_units(BASE)
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, rollouts, segments)
    with wh.connect() as connection:
        calls = connection.sql("SELECT tool_name, tool_status, count(*) FROM attempts WHERE has_call "
                               "GROUP BY ALL ORDER BY ALL").fetchall()
        failures = connection.sql("SELECT DISTINCT rollout_id, tool_name, error_type FROM failures "
                                  "WHERE rollout_id = 'it0-deep-s0'").fetchall()
    assert calls == [("code_interpreter", "ok", 1), ("convert_units", "error", 7), ("convert_units", "ok", 3)]
    assert failures == [("it0-deep-s0", "convert_units", "DimensionError")]
    client = TestClient(create_app(Browser(Warehouse(wh.root, read_only=True))), base_url="http://127.0.0.1")
    html = client.get("/rollouts/it0-deep-s0").text
    assert html.count('<span class="tool-name">convert_units</span>') == 4
    assert html.count('<span class="tool-name">code_interpreter</span>') == 2


# ---------------------------------------------------------------------------------------------
# A reward that hangs; a Ctrl-C


HANGS_ON_2 = ("import time\n"
              "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
              "    if extra_info['index'] == 2:\n"
              "        time.sleep(3600)\n"
              "    return 0.5\n")
FIXED = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.5\n"


def test_a_reward_past_its_timeout_is_one_line_and_resume_finishes_the_iteration(tmp_path, units):
    path = tmp_path / "reward.py"
    path.write_text(HANGS_ON_2)
    args = ["collect", "-w", str(tmp_path / "wh"), "--data", str(units), "--prompts", "4", "--group-size", "2",
            "--reward-fn", str(path), "--reward-timeout-s", "2", "--batch-rollouts", "1",
            "--max-concurrent-rollouts", "1", *TINY]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: reward function compute_score ({path}:compute_score) did not return within 2 s on "
                      "rollout it0-units-2-s0 (--reward-timeout-s); the parts committed stay, and --resume finishes "
                      "the iteration once it returns"]
    assert sorted(r.rollout_id for r in Warehouse(tmp_path / "wh").read_rollouts(0)) == [
        "it0-units-0-s0", "it0-units-0-s1", "it0-units-1-s0", "it0-units-1-s1"]
    path.write_text(FIXED)
    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert [r.reward for r in Warehouse(tmp_path / "wh").read_rollouts(0)] == [0.5] * 8


def _signal_dispositions(pid: int) -> str:
    """Each thread of process `pid`: its name and its blocked, ignored and caught signal masks."""
    from pathlib import Path

    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        lines.append(" ".join(f"{key}={status.get(key, '?').strip()}" for key in ("Name", "SigBlk", "SigIgn", "SigCgt")))
    return "\n".join(lines)


def test_one_ctrl_c_ends_a_collection_whose_reward_hangs_in_one_line(tmp_path, units):
    """SIGINT while a reward hangs: the process ends within seconds, says in one line what is
    committed, exits 130 without a traceback; --resume finishes once the reward is fixed."""
    import signal
    import subprocess
    import time

    from tests.helpers import cli, wait_for

    path = tmp_path / "reward.py"
    path.write_text(HANGS_ON_2)
    warehouse = tmp_path / "wh"
    args = ["collect", "-w", str(warehouse), "--data", str(units), "--prompts", "4", "--group-size", "2",
            "--reward-fn", str(path), "--batch-rollouts", "1", "--max-concurrent-rollouts", "1", *TINY]
    process = subprocess.Popen(cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rollouts = warehouse / "rollouts" / "iteration=0"
    wait_for(lambda: len(list(rollouts.glob("part-*.parquet"))) >= 4, 180, process)
    time.sleep(1.0)  # prompt 2's reward is hanging now
    signals = _signal_dispositions(process.pid)  # said if it does not stop
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"the collection did not end within 60 s of its Ctrl-C; its threads' signals when it was "
                    f"sent:\n{signals}\nit wrote:\n{stderr[-3000:]}")
    assert time.monotonic() - sent < 10
    assert process.returncode == 130
    assert "Traceback" not in stderr and "was destroyed but it is pending" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted: 4 of 8 rollouts are committed in 4 parts; --resume finishes the "
                      "collection"], stderr
    path.write_text(FIXED)
    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert len(Warehouse(warehouse).read_rollouts(0)) == 8


def test_relative_paths_are_stored_resolved_and_an_equivalent_spec_resumes(tmp_path, units, monkeypatch):
    """--data and --reward-fn typed relative to the working directory are stored as absolute paths
    (the reward's name written out): a resume spelling them otherwise is the same config, and purify
    run from another folder can check the iteration is complete (from the plan its collection
    recorded, even with the dataset moved; without a plan, from the dataset). Another option is
    refused by name."""
    import shutil

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(units, work / "units.parquet")
    (work / "reward.py").write_text(FIXED)
    monkeypatch.chdir(work)
    warehouse = tmp_path / "wh"
    common = ["-w", str(warehouse), "--prompts", "2", "--group-size", "2", *TINY]
    result = runner.invoke(app, ["collect", "--data", "units.parquet", "--reward-fn", "reward.py", "--batch-rollouts",
                                 "1", *common])
    assert result.exit_code == 0, result.output
    saved = json.loads(Warehouse(warehouse).collect_config(0))
    assert (saved["data"], saved["reward_fn"]) == (str(work / "units.parquet"), f"{work / 'reward.py'}:compute_score")
    # one rollout gone (a collection killed before its last part): resume with the absolute spelling
    stored = Warehouse(warehouse).read_rollouts(0)
    part = next(p for p in (warehouse / "rollouts" / "iteration=0").glob("part-*.parquet")
                if stored[-1].rollout_id in __import__("pyarrow.parquet", fromlist=["x"]).read_table(p).column(
                    "rollout_id").to_pylist())
    part.unlink()
    refused = runner.invoke(app, ["collect", "--data", str(work / "units.parquet"), "--reward-fn",
                                  f"{work / 'reward.py'}:compute_score", "--max-turns", "3", "--resume", *common])
    assert refused.exit_code == 1
    assert "collected with another config (--max-turns 8 then, 3 now)" in " ".join(refused.output.split())
    resumed = runner.invoke(app, ["collect", "--data", str(work / "units.parquet"), "--reward-fn",
                                  f"{work / 'reward.py'}:compute_score", "--resume", *common])
    assert resumed.exit_code == 0, resumed.output
    monkeypatch.chdir(tmp_path)  # purify from elsewhere: the stored paths still name the dataset
    purified = runner.invoke(app, ["purify", "-w", str(warehouse)])
    assert purified.exit_code == 0, purified.output
    (work / "units.parquet").rename(work / "moved.parquet")
    moved = runner.invoke(app, ["purify", "-w", str(warehouse), "--gamma", "0.7"])
    assert moved.exit_code == 0, moved.output  # the plan the collection recorded says what it planned
    (warehouse / "configs" / "collect-plan-iteration=0.json").unlink()  # as an older cleaner left it
    refused = runner.invoke(app, ["purify", "-w", str(warehouse), "--gamma", "0.9"])
    assert refused.exit_code == 1 and "cannot tell whether iteration 0 is complete" in " ".join(refused.output.split())
