"""The command line, through typer's CliRunner: exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.parts import list_parts
from tests.factories import make_rollout, make_segments
from tests.helpers import leaf_commands

runner = CliRunner()


def _warehouse(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    return wh


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("collect", "purify", "train", "run", "ablate", "eval", "sql", "show", "demo", "sandbox",
                    "compact"):
        assert command in result.output


@pytest.mark.parametrize("module", ["cleaner", "cleaner.cli"])
def test_python_dash_m_runs_the_same_app(module):
    """`python -m cleaner` and `python -m cleaner.cli`, in a fresh interpreter, are the console script."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage: python -m " + module in result.stdout
    assert all(command in result.stdout for command in ("collect", "purify", "train", "run", "report", "ui"))


def test_sql_table_csv_json(tmp_path):
    wh = _warehouse(tmp_path)
    query = "SELECT rollout_id, reward FROM rollouts ORDER BY rollout_id"
    result = runner.invoke(app, ["sql", query, "--warehouse", str(wh.root)])
    assert result.exit_code == 0, result.output
    assert "r0" in result.output and "2 rows" in result.output
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "--format", "csv"])
    assert result.output.splitlines() == ["rollout_id,reward", "r0,1.0", "r1,0.0"]
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "-f", "json", "-o", str(out)])
    assert result.exit_code == 0
    assert json.loads(out.read_text()) == [{"rollout_id": "r0", "reward": 1.0}, {"rollout_id": "r1", "reward": 0.0}]


def test_sql_csv_writes_nested_cells_as_json_text(tmp_path):
    """A token list, a struct or a map has no CSV form of its own: its cell is JSON text."""
    wh = _warehouse(tmp_path)
    query = ("SELECT seq, token_ids, {'kind': kind, 'ok': tool_status = 'ok'} AS s, map(['n'], [len(token_ids)]) AS m "
             "FROM segments WHERE rollout_id = 'r0' AND seq IN (0, 2) ORDER BY seq")
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "seq,token_ids,s,m",
        '0,"[1, 2, 3]","{""kind"": ""prompt"", ""ok"": null}","[[""n"", 3]]"',
        '2,"[7, 8]","{""kind"": ""tool"", ""ok"": false}","[[""n"", 2]]"']
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "--format", "json"])  # JSON keeps them nested
    assert json.loads(result.output)[0]["token_ids"] == [1, 2, 3]


def test_sql_bad_query_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["sql", "SELECT nope FROM rollouts", "-w", str(_warehouse(tmp_path).root)])
    assert result.exit_code != 0
    assert "query failed" in result.output


def test_sql_names_a_truncated_file(tmp_path):
    wh = _warehouse(tmp_path)
    bad = list_parts(wh.root, schema.SEGMENTS)[0]
    content = bad.read_bytes()
    bad.write_bytes(content[:100])
    result = runner.invoke(app, ["sql", "SELECT 1", "-w", str(wh.root)])
    assert result.exit_code == 1
    assert bad.name in result.output.replace("\n", "") and "not a readable Parquet file" in result.output
    assert bad.read_bytes() == content[:100]


def test_compact_merges_and_sql_reads_the_same_rows(tmp_path):
    wh = _warehouse(tmp_path)
    wh.write_rollouts(0, [make_rollout("r2")], make_segments("r2"))
    query = ["sql", "SELECT rollout_id, count(*) FROM segments GROUP BY 1 ORDER BY 1", "-w", str(wh.root), "-f", "csv"]
    before = runner.invoke(app, query).output
    result = runner.invoke(app, ["compact", "-w", str(wh.root), "--iteration", "0"])
    assert result.exit_code == 0, result.output
    assert "merged 4 parts into 2" in result.output  # two rollouts parts and their two segments twins
    assert len(list_parts(wh.root, schema.ROLLOUTS)) == 1
    assert runner.invoke(app, query).output == before == "rollout_id,count_star()\nr0,6\nr1,6\nr2,6\n"
    result = runner.invoke(app, ["compact", "-w", str(wh.root), "--dataset", "nope"])
    assert result.exit_code == 1 and "unknown dataset 'nope'" in result.output


def test_sql_missing_warehouse(tmp_path):
    result = runner.invoke(app, ["sql", "SELECT 1", "-w", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no such warehouse" in result.output


def test_show_prints_segments_in_order(tmp_path):
    wh = _warehouse(tmp_path)
    result = runner.invoke(app, ["show", "r0", "-w", str(wh.root)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("prompt") < out.index("step 0 attempt 0") < out.index("step 0 attempt 1")
    assert "error NameError" in out and "retry" in out
    missing = runner.invoke(app, ["show", "nope", "-w", str(wh.root)])
    assert missing.exit_code == 1 and "no rollout 'nope'" in missing.output


# ---------------------------------------------------------------------------------------------
# show: the purified view beside the raw one (no tokenizer: no collect config in these warehouses)


def _show(wh, *options):
    return runner.invoke(app, ["show", "r0", "-w", str(wh.root), *options], env={"COLUMNS": "200"})


def test_show_marks_outcomes_and_removed_spans(tmp_path):
    # make_segments: a_0 calls pirnt(1) (NameError), a_1 calls print(1): difflib ratio 0.875.
    result = _show(_warehouse(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "step 0 · shallow · 2 attempts · a1 shallow (sim 0.88) · removed #2, 5 tok" in out
    assert "step 1 · clean · 1 attempt" in out
    assert "tokens removed 5 · shallow 1 · deep 0 · unrecovered 0" in out
    assert "#1 (3 tok)  partly removed (keeps tokens 0:1)" in out  # a_0's reasoning stays
    assert "error NameError  #2 (2 tok)  removed" in out  # the error response goes
    assert "#3 (3 tok)  partly removed (keeps tokens 1:3)" in out  # a_1's call replaces a_0's
    assert "no collect config" in out and "no purified rows for this rollout in iteration 0" in out
    deep = _show(_warehouse(tmp_path / "deep"), "--gamma", "0.9").output
    assert "step 0 · deep · 2 attempts · a1 deep (sim 0.88) · removed #1 #2, 5 tok" in deep
    assert "#1 (3 tok)  removed" in deep and "#3 (3 tok)  partly" not in deep
    assert "shallow 0 · deep 1 · unrecovered 0" in deep


def test_show_lists_purified_configs_and_advantage(tmp_path):
    from cleaner.records import PurifiedRow, PurifyConfigRow

    wh = _warehouse(tmp_path)

    def row(rollout_id, advantage):
        return PurifiedRow("cfg0123abcd", 0, rollout_id, "it0-p0", (1, 2), 1, (0, 1), (0.0, -0.5),
                           (0.0, -0.5), 1.0, advantage, True, 1, 0, 0, 5, "test")

    wh.write_purified(0, PurifyConfigRow("cfg0123abcd", 0.7, 0.5, "call", "positive", "{}"),
                      [row("r0", 0.70710677), row("r1", -0.70710677)])
    out = _show(wh).output
    assert "purified rows of this rollout (iteration 0)" in out
    line = next(line for line in out.splitlines() if "cfg0123abcd" in line)
    assert [cell.strip() for cell in line.strip("│ ").split("│")] == [
        "cfg0123abcd", "0.7", "0.5", "call", "positive", "replace", "True", "1", "0", "0", "5", "1.000", "+0.707"]


def test_show_edit_mask_marks_what_is_kept_untrained(tmp_path):
    # the shallow merge drops a_0's call (tokens 1:3) and a_1's reasoning; a_1's call succeeded,
    # so under mask only a_0's call is untrained, and nothing is removed
    out = _show(_warehouse(tmp_path), "--edit", "mask").output
    assert "masked view (gamma 0.5, similarity on code)" in out
    assert "#1 (3 tok)  partly masked (tokens 1:3 not trained)" in out
    assert "removed" not in out.replace("tokens removed", "")
    assert "tokens masked 2 · shallow 1 · deep 0 · unrecovered 0" in out
    assert "step 0 · shallow · 2 attempts · a1 shallow (sim 0.88) · masked 2 tok" in out
    bad = _show(_warehouse(tmp_path / "bad"), "--edit", "splice")
    assert bad.exit_code == 1 and "edit must be one of" in bad.output


def test_show_view_option_and_bad_options(tmp_path):
    wh = _warehouse(tmp_path)
    raw = _show(wh, "--view", "raw").output
    assert "attempt 1" in raw and "purified view" not in raw and "removed" not in raw
    purified = _show(wh, "--view", "purified").output
    assert "purified view (gamma 0.5, similarity on code)" in purified and "(3 tok)" not in purified
    no_decode = _show(wh, "--similarity-on", "call").output  # call similarity needs the tokenizer
    assert "cannot render the purified view" in no_decode and "decode" in no_decode
    bad = _show(wh, "--gamma", "-1")
    assert bad.exit_code == 1 and "gamma must be >= 0" in bad.output
    assert _show(wh, "--view", "sideways").exit_code == 2


def test_show_decodes_with_the_collecting_policys_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    wh = _warehouse(tmp_path)
    tokenizer = Tokenizer(models.WordLevel({chr(ord("a") + i): i for i in range(26)}, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()  # id i <-> letter i, no spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path / "policy")
    wh.save_config("collect-iteration=0", json.dumps({"model": str(tmp_path / "policy")}))
    out = _show(wh, "--view", "purified").output
    lines = [line.strip("│ ") for line in out.splitlines()]
    # prompt 1 2 3; merged turn: a_0's reasoning (4) + a_1's call (5 9), then t_1 (7 10); the answer 11 12
    assert lines[lines.index("bcd") + 1:lines.index("bcd") + 5] == [
        "── step 0 · shallow · 2 attempts · a1 shallow (sim 0.88) · removed #2, 5 tok ──", "efjhk",
        "── step 1 · clean · 1 attempt ──", "lm"]
    assert f"with the tokenizer of {tmp_path / 'policy'}" in out.replace("│\n│ ", "")
    assert "stored segment text" in _show(wh, "--view", "purified", "--no-tokenizer").output


# ---------------------------------------------------------------------------------------------
# run: every option from flags or from a TOML file


RUN_FLAGS = ["--run-dir", "runs/x", "--iterations", "15", "--prompts", "16", "--group-size", "4",
             "--rollback-prob", "0", "--collect-view", "raw", "--gamma", "1.5", "--similarity-on", "call",
             "--max-retries", "2", "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "96",
             "--lr", "2e-6", "--warmup-steps", "20", "--clip-ratio-c", "0", "--rollout-is", "token",
             "--mini-batch-size", "8", "--seed", "3"]
RUN_TOML = """run_dir = "runs/x"
iterations = 15
[collect]
n_prompts = 16
group_size = 4
rollback_prob = 0
collect_view = "raw"
gamma = 1.5
similarity_on = "call"
max_retries = 2
temperature = 0.8
top_p = 0.9
max_new_tokens = 96
seed = 3
[train]
lr = 2e-6
warmup_steps = 20
clip_ratio_c = 0
rollout_is = "token"
mini_batch_size = 8
"""


def test_run_config_file_and_flags_resolve_to_the_same_config(tmp_path):
    from_flags = runner.invoke(app, ["run", *RUN_FLAGS, "--print-config"])
    assert from_flags.exit_code == 0, from_flags.output
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    from_file = runner.invoke(app, ["run", "--config", str(path), "--print-config"])
    assert from_file.exit_code == 0, from_file.output
    assert from_file.output == from_flags.output
    printed = tmp_path / "printed.toml"
    printed.write_text(from_file.output)  # the printed config reads back to itself
    assert runner.invoke(app, ["run", "--config", str(printed), "--print-config"]).output == from_file.output
    import tomllib

    resolved = tomllib.loads(from_file.output)
    # flags set collect's and purify's values together; derived values follow collect's
    assert resolved["purify"]["gamma"] == 1.5 and resolved["purify"]["rollback_prob"] == 0.0
    assert resolved["purify"]["similarity_on"] == "call"
    assert (resolved["train"]["seed"], resolved["train"]["micro_batch_size"]) == (3, 8)
    assert resolved["collect"]["max_response_tokens"] == resolved["train"]["max_response_tokens"] == 768
    # a flag overrides the file
    override = runner.invoke(app, ["run", "--config", str(path), "--lr", "1e-3", "--print-config"])
    assert "lr = 0.001" in override.output and "lr = 2e-06" not in override.output


def test_run_config_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlearning_rate = 1e-3\n")
    result = runner.invoke(app, ["run", "--config", str(path), "--print-config"])
    assert result.exit_code == 1 and "unknown key(s) ['learning_rate']" in result.output
    assert "bad.toml" in result.output.replace("\n", "")
    path.write_text("[train]\nlr = 'fast'\n")
    result = runner.invoke(app, ["run", "--config", str(path), "--print-config"])
    assert result.exit_code == 1 and "train.lr: expected float, got 'fast'" in result.output
    path.write_text("[train\n")
    result = runner.invoke(app, ["run", "--config", str(path), "--print-config"])
    assert result.exit_code == 1 and "not valid TOML" in result.output
    result = runner.invoke(app, ["run", "--collect-view", "sideways", "--print-config"])
    assert result.exit_code == 1 and "invalid option: --collect-view must be one of" in result.output


def test_run_resume_keeps_the_saved_config(tmp_path):
    run_dir = tmp_path / "run"
    first = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--lr", "3e-4", "--print-config"])
    Warehouse(run_dir / "warehouse").save_config("run", json.dumps(_resolved(first.output)))
    resumed = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--resume", "--iterations", "9",
                                  "--print-config"])
    assert resumed.exit_code == 0, resumed.output
    assert "lr = 0.0003" in resumed.output and "iterations = 9" in resumed.output
    changed = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--resume", "--lr", "1e-3"])
    assert changed.exit_code == 1 and "train.lr: 0.0003 -> 0.001" in changed.output
    # how rollouts are scheduled is not what they contain: a resumed run may schedule them otherwise
    rescheduled = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--resume", "--max-concurrent-rollouts", "8",
                                      "--batch-rollouts", "5", "--schedule", "lockstep", "--print-config"])
    assert rescheduled.exit_code == 0, rescheduled.output
    assert "max_concurrent_rollouts = 8" in rescheduled.output and 'schedule = "lockstep"' in rescheduled.output


def test_run_edit_mask_collects_raw_unless_told_otherwise():
    masked = _resolved(runner.invoke(app, ["run", "--edit", "mask", "--print-config"]).output)
    assert masked["purify"]["edit"] == "mask" and masked["collect"]["collect_view"] == "raw"
    told = _resolved(runner.invoke(app, ["run", "--edit", "mask", "--collect-view", "purified",
                                         "--print-config"]).output)
    assert told["collect"]["collect_view"] == "purified"
    assert _resolved(runner.invoke(app, ["run", "--print-config"]).output)["collect"]["collect_view"] == "purified"
    refused = runner.invoke(app, ["run", "--edit", "mask", "--negative-samples", "--print-config"])
    assert refused.exit_code == 1 and "does not combine with --negative-samples" in refused.output


def test_a_run_saved_before_a_field_existed_resumes(tmp_path):
    run_dir = tmp_path / "run"
    saved = _resolved(runner.invoke(app, ["run", "--run-dir", str(run_dir), "--print-config"]).output)
    del saved["purify"]["edit"]  # as a run started before purify had an edit saved it
    Warehouse(run_dir / "warehouse").save_config("run", json.dumps(saved))
    resumed = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--resume", "--print-config"])
    assert resumed.exit_code == 0, resumed.output
    assert 'edit = "replace"' in resumed.output
    changed = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--resume", "--edit", "mask"])
    assert changed.exit_code == 1 and "purify.edit: 'replace' -> 'mask'" in changed.output


def _resolved(toml_text: str) -> dict:
    import tomllib

    from cleaner.config.layers import resolve_run_config

    return resolve_run_config(tomllib.loads(toml_text)).to_dict()


def _warehouse_of_hostile_text(tmp_path) -> Warehouse:
    """One rollout whose model text holds terminal controls and rich markup."""
    import dataclasses

    texts = {1: "\x1b[2J\x1b]0;pwned\x07<tool_call>", 3: "ok\rOVERWRITTEN\x9b31m[/bold] [red]x<tool_call>",
             5: "\x08\x7fdone"}
    segments = [dataclasses.replace(s, text=texts.get(s.seq, s.text)) for s in make_segments("r0")]
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0")], segments)
    return wh


def test_show_and_sql_print_control_characters_escaped(tmp_path):
    wh = _warehouse_of_hostile_text(tmp_path)
    shown = runner.invoke(app, ["show", "r0", "-w", str(wh.root)], env={"COLUMNS": "200"})
    queried = runner.invoke(app, ["sql", "SELECT seq, text FROM segments ORDER BY seq", "-w", str(wh.root)],
                            env={"COLUMNS": "200"})
    for result in (shown, queried):
        assert result.exit_code == 0, result.output
        assert not any(c in result.output for c in "\x1b\x07\r\x9b\x08\x7f"), repr(result.output)
        for escaped in ("\\x1b[2J\\x1b]0;pwned\\x07", "ok\\rOVERWRITTEN\\x9b31m[/bold] [red]x", "\\x08\\x7fdone"):
            assert escaped in result.output, (escaped, result.output)


def test_every_help_is_readable_at_80_columns():
    """Every option name appears whole (rich's table cut them: --rollback-is-thre…), no line is
    wider than the terminal, and run's panels are sections."""
    import re

    import typer

    leaves = leaf_commands()
    assert len(leaves) == 17  # the 13 phase, loop and read commands, ui, export, curate and warehouse
    for path, command in [((), typer.main.get_command(app)), *leaves]:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert max(len(line) for line in result.output.splitlines()) <= 80, (path, result.output)
        assert "…" not in result.output, (path, result.output)
        for param in command.params:
            for name in [*param.opts, *param.secondary_opts]:
                if name.startswith("-"):
                    assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), (path, name)
        if path == ("run",):
            assert [line for line in result.output.splitlines() if line.endswith(":") and not line.startswith(" ")] \
                == ["Options:", "Collect:", "Purify:", "Train:", "Logging:"]


@pytest.mark.parametrize("hard", [800, None])
def test_the_open_files_soft_limit_is_raised_within_the_hard_one(hard):
    """A cluster job starting at a soft 512 descriptors: every cleaner command raises it to 65,536,
    or to the hard limit where that is lower, before it opens anything (a thousand rollouts in
    flight hold a socket each)."""
    import resource

    _, ours = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = ours if hard is None else hard
    expected = 65_536 if hard == resource.RLIM_INFINITY else min(65_536, hard)
    code = ("import resource\n"
            "from cleaner.cli import app\n"
            "try:\n"
            "    app(['sql', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"soft {expected}"
