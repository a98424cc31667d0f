"""`cleaner export` end to end on the small run's warehouse (engine/export/job.py): rows against the
warehouse they came from, pair counts against the documented SQL, shards, the card, and every
refusal as one line with nothing written."""

from __future__ import annotations

import json
import math

import duckdb
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY
from cleaner.engine.export.job import ExportRequest, export_job
from cleaner.warehouse import Warehouse
from tests.helpers import tree_digest

runner = CliRunner()

# docs/export.md's counts, spelled here as a user would type them over `cleaner sql`
FIXED_CHAINS_SQL = """
WITH steps AS (
  SELECT rollout_id, step, bool_or(tool_status <> 'ok') AS failed,
         arg_max(tool_status, attempt) = 'ok' AS fixed, bool_or(tool_status = 'infra_error') AS infra
  FROM segments WHERE kind = 'tool' AND iteration = {it} GROUP BY rollout_id, step),
first_unrecovered AS (SELECT rollout_id, min(step) AS step FROM steps WHERE failed AND NOT fixed GROUP BY rollout_id)
SELECT count(*) FROM steps s LEFT JOIN first_unrecovered u USING (rollout_id)
WHERE s.failed AND s.fixed AND NOT s.infra AND (u.step IS NULL OR s.step < u.step)"""


def _export(small_run, tmp_path, **changes):
    request = ExportRequest(**{"iterations": (0,), "form": "sft", "out": tmp_path / "ds", **changes})
    outcome = export_job(Warehouse(small_run / "warehouse"), request, progress=False)
    return outcome, pq.read_table(outcome.out / "data").to_pylist() if request.form != "messages" else None


def _sql(small_run, query: str):
    return Warehouse(small_run / "warehouse").connect().sql(query).fetchall()


def test_sft_has_one_exact_conversation_per_rollout_with_its_provenance(small_run, tmp_path):
    outcome, rows = _export(small_run, tmp_path)
    stored = {r[0]: r[1:] for r in _sql(small_run, "SELECT rollout_id, reward, policy_version, collect_config_id, "
                                                   "group_id FROM rollouts WHERE iteration = 0")}
    assert outcome.rows == len(rows) == len(stored) == 16
    assert all(row["exact"] for row in rows) and outcome.exact == 16
    for row in rows:
        assert (row["reward"], row["policy_version"], row["collect_config_id"], row["group_id"]) == stored[row["rollout_id"]]
    (rollout_id, text), = _sql(small_run, "SELECT rollout_id, text FROM segments WHERE iteration = 0 AND seq = 1 "
                                          "AND kind = 'assistant' ORDER BY rollout_id LIMIT 1")
    row = next(row for row in rows if row["rollout_id"] == rollout_id)
    assistant = row["messages"][1]
    assert assistant["role"] == "assistant" and text.startswith(assistant["content"])
    code = json.loads(assistant["tool_calls"][0]["function"]["arguments"])["code"]
    assert f'"code": {json.dumps(code)}' in text  # the call's arguments, as the model wrote them


def test_chain_pairs_are_the_chains_the_documented_sql_counts(small_run, tmp_path):
    outcome, rows = _export(small_run, tmp_path, form="preference")
    ((counted,),) = _sql(small_run, FIXED_CHAINS_SQL.format(it=0))
    assert outcome.rows == len(rows) == counted == outcome.counted > 0
    by_id = {}
    for row in rows:
        by_id.setdefault(row["rollout_id"], []).append(row)
    row = rows[0]
    segments = _sql(small_run, f"SELECT seq, kind, step, attempt, text, tool_status FROM segments WHERE rollout_id = "
                               f"'{row['rollout_id']}' ORDER BY seq")
    first = next(s for s in segments if s[1] == "assistant" and s[2] == row["step"] and s[3] == 0)
    assert row["rejected"][0]["role"] == "assistant" and first[4].startswith(row["rejected"][0]["content"])
    answer = next(s for s in segments if s[1] == "tool" and s[2] == row["step"] and s[3] == 0)
    assert answer[5] != "ok" and row["depth"] in ("shallow", "deep", "mixed") and row["pair"] == "chain"
    assert row["chosen"][0]["tool_calls"] != row["rejected"][0]["tool_calls"]
    assert row["prompt"][-1]["role"] in ("user", "tool")  # the conversation up to the failed call


def test_outcome_pairs_match_the_ith_correct_with_the_ith_incorrect_of_a_group(small_run, tmp_path):
    outcome, rows = _export(small_run, tmp_path, form="preference", pairs="outcome")
    groups = _sql(small_run, "SELECT group_id, list(rollout_id ORDER BY sample_index) FILTER (WHERE correct), "
                             "list(rollout_id ORDER BY sample_index) FILTER (WHERE NOT correct) FROM rollouts "
                             "WHERE iteration = 0 GROUP BY 1")
    expected = {(good, bad) for _, goods, bads in groups for good, bad in zip(goods or [], bads or [], strict=False)}
    assert {(row["rollout_id"], row["rejected_rollout_id"]) for row in rows} == expected
    assert outcome.counted == len(rows) == len(expected)


def test_messages_are_openai_chat_lines(small_run, tmp_path):
    outcome, _ = _export(small_run, tmp_path, form="messages")
    (shard,) = sorted((outcome.out / "data").iterdir())
    assert shard.name == "train-00000-of-00001.jsonl"
    lines = [json.loads(line) for line in shard.read_text().splitlines()]
    assert len(lines) == 16
    calls = [(m, lines[0]["messages"][i + 1]) for i, m in enumerate(lines[0]["messages"]) if m.get("tool_calls")]
    message, answer = calls[0]
    assert isinstance(message["tool_calls"][0]["function"]["arguments"], str)  # a JSON string, as OpenAI's
    assert answer == {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": answer["content"]}
    assert lines[0]["tools"][0]["function"]["name"] == "code_interpreter"


def test_shards_hold_a_fixed_number_of_rows_and_the_card_says_what_was_exported(small_run, tmp_path):
    outcome, _ = _export(small_run, tmp_path, iterations=(0, 1), rows_per_shard=7,
                         where="correct and n_failed_calls = 0")
    ((selected,),) = _sql(small_run, "SELECT count(*) FROM rollouts WHERE iteration IN (0, 1) AND correct "
                                     "AND n_failed_calls = 0")
    shards = sorted((outcome.out / "data").iterdir())
    assert outcome.rows == selected and len(shards) == outcome.shards == math.ceil(selected / 7)
    assert [pq.read_metadata(s).num_rows for s in shards] == [7] * (selected // 7) + ([selected % 7] if selected % 7 else [])
    assert shards[0].name == f"train-00000-of-{len(shards):05d}.parquet"
    card = (outcome.out / "README.md").read_text()
    assert f"num_examples: {selected}" in card and "`correct and n_failed_calls = 0`" in card
    assert "- iterations: 0, 1" in card and str((small_run / "warehouse").resolve()) in card


def test_purified_view_is_the_stored_row_under_a_config(small_run, tmp_path):
    (config_id,), = _sql(small_run, "SELECT DISTINCT config_id FROM purified WHERE iteration = 0")
    outcome, rows = _export(small_run, tmp_path, view="purified")
    assert {row["purify_config_id"] for row in rows} == {config_id} and outcome.exact == 16
    # a rolled-back rollout loses its failed attempts: fewer messages than its raw conversation
    raw = {row["rollout_id"]: row for row in _export(small_run, tmp_path / "raw")[1]}
    shorter = [row for row in rows if len(row["messages"]) < len(raw[row["rollout_id"]]["messages"])]
    ((rolled_back,),) = _sql(small_run, f"SELECT count(*) FROM purified WHERE config_id = '{config_id}' AND "
                                        "iteration = 0 AND n_shallow + n_deep > 0 AND negative_seq IS NULL")
    assert len(shorter) == rolled_back > 0


def test_the_export_never_writes_the_warehouse(small_run, tmp_path):
    digest = tree_digest(small_run / "warehouse")
    _export(small_run, tmp_path, form="preference")
    assert tree_digest(small_run / "warehouse") == digest


# ---------------------------------------------------------------------------------------------
# Refusals: one line, nothing written


def _refused(small_run, tmp_path, args: list[str], *expected: str) -> None:
    out = tmp_path / "ds"
    result = runner.invoke(app, ["export", "-w", str(small_run / "warehouse"), "--out", str(out), *args])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in result.output, result.output
    for text in expected:
        assert text in output, (text, output)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ds")]


@pytest.mark.parametrize(("args", "expected"), [
    (["--iteration", "7", "--format", "sft"], ["iteration 7 is not collected", "collected: 0, 1"]),
    (["--iteration", "0", "--format", "parquet"], ["--format", "sft, preference, messages", "'parquet'"]),
    (["--iteration", "0", "--format", "sft", "--where", "correct and"], ["--where 'correct and'"]),
    (["--iteration", "0", "--format", "sft", "--where", "nonsense_column > 1"], ["nonsense_column"]),
    (["--iteration", "0", "--format", "sft", "--where", "true; DROP TABLE rollouts"], ["expected one condition"]),
    (["--iteration", "0", "--format", "sft", "--where", "true) OR (true"], ["is not valid SQL", "near \")\""]),
    (["--iteration", "0", "--format", "sft", "--where", "(correct)) OR ((true"], ["is not valid SQL"]),
    (["--iteration", "0", "--format", "sft", "--where", "true UNION SELECT * FROM rollouts"], ["expected one condition"]),
    (["--iteration", "0", "--format", "sft", "--where", "correct ORDER BY reward LIMIT 1"], ["expected one condition"]),
    (["--iteration", "0", "--format", "sft", "--where", "true GROUP BY 1"], ["expected one condition"]),
    (["--iteration", "0", "--format", "sft", "--where", "false"],
     ["iteration(s) 0 hold no rollout for which --where 'false' holds: nothing to export"]),
    (["--iteration", "0", "--format", "preference", "--where", "n_failed_calls = 0"],
     ["hold no chain pair (the documented SQL count is 0", "nothing to export"]),
    (["--iteration", "x", "--format", "sft"], ["--iteration takes comma-separated iteration numbers"]),
])
def test_bad_input_is_one_line_and_nothing_is_written(small_run, tmp_path, args, expected):
    _refused(small_run, tmp_path, args, *expected)


def test_an_unpurified_iteration_is_refused_for_the_purified_view(small_run, tmp_path):
    wh = tmp_path / "wh"
    import shutil

    shutil.copytree(small_run / "warehouse", wh)
    shutil.rmtree(wh / "purified" / "iteration=0")
    out = tmp_path / "ds"
    result = runner.invoke(app, ["export", "-w", str(wh), "--out", str(out), "--iteration", "0", "--format", "sft",
                                 "--view", "purified"])
    assert result.exit_code == 1 and "iteration 0 is not purified" in " ".join(result.output.split())
    assert not out.exists()


def test_a_policy_without_a_chat_template_is_refused(small_run, tmp_path):
    import shutil

    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_POLICY, policy)
    (policy / "chat_template.jinja").unlink()
    _refused(small_run, tmp_path, ["--iteration", "0", "--format", "sft", "--policy", str(policy)],
             "has no chat template")


def test_out_holding_anything_is_refused_unless_overwrite(small_run, tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["export", "-w", str(small_run / "warehouse"), "--out", str(out), "--iteration", "0",
                                 "--format", "sft"])
    assert result.exit_code == 1 and "pass --overwrite" in " ".join(result.output.split())
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    args = ["export", "-w", str(small_run / "warehouse"), "--out", str(out), "--iteration", "0", "--format", "sft"]
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, args).exit_code == 1  # now it holds a dataset: --overwrite replaces it
    result = runner.invoke(app, [*args, "--overwrite"])
    assert result.exit_code == 0 and "16 rows from 16 rollouts" in result.output


def test_the_cli_reads_what_the_job_wrote(small_run, tmp_path):
    out = tmp_path / "ds"
    args = ["export", "-w", str(small_run / "warehouse"), "--out", str(out), "--iteration", "0,1", "--format",
            "preference"]
    result = runner.invoke(app, args)  # iteration 1 is purified under three configs: which SAAR?
    assert result.exit_code == 1 and "choose one with --config-id" in " ".join(result.output.split())
    (config_id,), = _sql(small_run, "SELECT DISTINCT config_id FROM purified WHERE iteration = 0")
    result = runner.invoke(app, [*args, "--config-id", config_id[:6]])
    assert result.exit_code == 0, result.output
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/data/*.parquet')").fetchall()[0][0]
    ((counted,),) = _sql(small_run, FIXED_CHAINS_SQL.format(it=0))
    ((counted_1,),) = _sql(small_run, FIXED_CHAINS_SQL.format(it=1))
    assert rows == counted + counted_1 and f"SQL counts {rows:,} pairs" in result.output


# ---------------------------------------------------------------------------------------------
# Chains SAAR does not purify are no pairs, by the walk and by the SQL alike


def _hand_warehouse(root):
    """Three rollouts of the tiny chat format: A fails step 0 for good, then fixes step 1 (SAAR
    renders A raw from its unrecovered step on: no pair); B fixes steps 0 and 1 (two pairs); C fixes
    a call that met an infrastructure fault (not the policy's failure: no pair)."""
    from transformers import AutoTokenizer

    from cleaner.engine.model.chat import format_call, tool_response_text
    from cleaner.records import Segment, SegmentKind, ToolStatus
    from tests.factories import make_rollout

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY)

    def segment(rollout_id, seq, kind, step, attempt, text, status=None, code=None):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        assistant = kind == SegmentKind.ASSISTANT
        call_start = next((i for i in range(len(ids)) if "<tool_call>" in tokenizer.decode(ids[:i + 1])), None) \
            if assistant else None
        return Segment(rollout_id, 0, seq, kind, step, attempt, ids, (-0.1,) * len(ids) if assistant else None, text,
                       call_start=call_start, tool_code=code, tool_status=status)

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], tokenize=False,
                                           add_generation_prompt=True)
    plans = {"A": [[ToolStatus.ERROR, ToolStatus.ERROR], [ToolStatus.ERROR, ToolStatus.OK]],
             "B": [[ToolStatus.ERROR, ToolStatus.OK], [ToolStatus.TIMEOUT, ToolStatus.OK]],
             "C": [[ToolStatus.INFRA_ERROR, ToolStatus.OK]]}
    rollouts, segments = [], []
    for rollout_id, steps in plans.items():
        own = [segment(rollout_id, 0, SegmentKind.PROMPT, None, None, prompt)]
        for step, statuses in enumerate(steps):
            for attempt, status in enumerate(statuses):
                code = f"print(6 * {7 + attempt})"
                own.append(segment(rollout_id, len(own), SegmentKind.ASSISTANT, step, attempt,
                                   "Compute.\n" + format_call(code), code=code))
                own.append(segment(rollout_id, len(own), SegmentKind.TOOL, step, attempt,
                                   tool_response_text("Tool call failure" if status != ToolStatus.OK else "42"), status))
        own.append(segment(rollout_id, len(own), SegmentKind.ASSISTANT, len(steps), 0, "\\boxed{42}<|im_end|>"))
        segments += own
        rollouts.append(make_rollout(rollout_id))
    Warehouse(root).write_rollouts(0, rollouts, segments)


def test_a_chain_after_an_unrecovered_step_or_an_infra_fault_is_no_pair(tmp_path):
    _hand_warehouse(tmp_path / "wh")
    request = ExportRequest(iterations=(0,), form="preference", out=tmp_path / "ds", policy=DEFAULT_POLICY)
    outcome = export_job(Warehouse(tmp_path / "wh"), request, progress=False)
    rows = pq.read_table(outcome.out / "data").to_pylist()
    assert sorted((row["rollout_id"], row["step"], row["error_type"]) for row in rows) == [
        ("B", 0, "error"), ("B", 1, "timeout")]
    assert outcome.counted == 2
    (counted,), = Warehouse(tmp_path / "wh").connect().sql(FIXED_CHAINS_SQL.format(it=0)).fetchall()
    assert counted == 2
    first = next(row for row in rows if row["step"] == 1)
    assert [m["role"] for m in first["prompt"]] == ["user", "assistant", "tool"]  # step 0 as SAAR renders it
    assert json.loads(first["chosen"][0]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(6 * 8)"}
    assert json.loads(first["rejected"][0]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(6 * 7)"}
    assert first["depth"] == "shallow"  # "print(6 * 7)" vs "print(6 * 8)": ratio 11/12 >= gamma 0.5


# ---------------------------------------------------------------------------------------------
# Where the folder goes, who may read it, who wins


def test_out_inside_the_warehouse_is_refused_and_nothing_is_written(small_run, tmp_path):
    """A folder in a partition (or anywhere under the warehouse) would be read as part of it."""
    warehouse = small_run / "warehouse"
    before = tree_digest(warehouse)
    for out in (warehouse / "rollouts" / "iteration=0" / "ds", warehouse / "ds", warehouse):
        result = runner.invoke(app, ["export", "-w", str(warehouse), "--out", str(out), "--iteration", "0",
                                     "--format", "sft", "--overwrite"])
        output = " ".join(result.output.split())
        assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in output, output
        assert f"--out {out} is inside the warehouse {warehouse}" in output
    assert tree_digest(warehouse) == before


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True)
def test_a_dataset_is_made_as_mkdir_and_open_make_them(small_run, tmp_path, umask):
    from tests.helpers import wrong_modes

    outcome, _ = _export(small_run, tmp_path)
    assert list((outcome.out / "data").iterdir()) and wrong_modes(outcome.out, umask) == []


def test_of_two_exports_racing_to_one_new_out_exactly_one_wins(small_run, tmp_path, monkeypatch):
    """The second export to finish finds the first's folder there: it says so in one line and
    leaves the first's dataset as it was."""
    import cleaner.engine.export.job as job

    out = tmp_path / "ds"
    written = job.card
    racing = []

    def card_after_another_export(facts):
        if not racing:  # the first export to write its card lets another one finish first
            racing.append(True)
            racing.append(export_job(Warehouse(small_run / "warehouse"),
                                     ExportRequest(iterations=(1,), form="sft", out=out), progress=False))
        return written(facts)

    monkeypatch.setattr(job, "card", card_after_another_export)
    result = runner.invoke(app, ["export", "-w", str(small_run / "warehouse"), "--out", str(out), "--iteration", "0",
                                 "--format", "sft"])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in output, output
    assert f"{out}: another writer put a dataset there while this one was writing; that one is kept" in output
    assert racing[1].out == out and {row["iteration"] for row in pq.read_table(out / "data").to_pylist()} == {1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


# ---------------------------------------------------------------------------------------------
# --where is one condition


def test_a_where_is_one_condition_a_comment_included(small_run, tmp_path):
    """A trailing comment ends at its line; a ';' inside a string literal is no second statement."""
    ((correct,),) = _sql(small_run, "SELECT count(*) FROM rollouts WHERE iteration = 0 AND correct")
    outcome, rows = _export(small_run, tmp_path, where="correct -- the ones that got it right")
    assert outcome.rollouts == len(rows) == correct > 0 and all(row["correct"] for row in rows)
    outcome, _ = _export(small_run, tmp_path / "literal", where="rollout_id <> 'a;b' AND correct")
    assert outcome.rollouts == correct


def test_a_parenthesis_that_escapes_never_selects_another_iteration(small_run, tmp_path):
    """`true) OR (true` would have read `iteration IN (0) AND (true) OR (true)`: iteration 1 too."""
    _refused(small_run, tmp_path, ["--iteration", "0", "--format", "sft", "--where", "true) OR (true"],
             "--where 'true) OR (true' is not valid SQL")
    _refused(small_run, tmp_path, ["--iteration", "0", "--format", "sft", "--where", "true)) OR ((true"],
             "--where 'true)) OR ((true' is not valid SQL")


def test_a_ctrl_c_during_a_long_where_stops_the_export_in_one_line(small_run, tmp_path):
    """A real SIGINT while DuckDB runs the selection's query: exit 130 within seconds, one line, no
    folder and no temporary beside it."""
    from tests.helpers import cli, ctrl_c_when

    out, log = tmp_path / "ds", tmp_path / "stderr.txt"
    long_where = "(SELECT sum(hash(a)) FROM range(1000000000000) t(a)) IS NOT NULL"  # hours on any machine
    returncode, text, errors = ctrl_c_when(cli("-v", "export", "-w", str(small_run / "warehouse"), "--iteration", "0",
                                               "--format", "sft", "--out", str(out), "--where", long_where),
                                           log, "selecting the rollouts", 1.0, "export")
    assert returncode == 130 and "Traceback" not in text, text
    assert errors == [f"error: interrupted: nothing was written ({out} is as it was)"], text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stderr.txt"]


def test_a_folder_without_rows_is_never_swapped_in(small_run, tmp_path, monkeypatch):
    """Should the documented count say there are pairs where the walk finds none, the export
    refuses at the end and leaves nothing: a folder of no rows is no dataset."""
    import cleaner.engine.export.job as job
    from cleaner.errors import JobError

    monkeypatch.setattr(job.selection, "count", lambda connection, query: 1)
    with pytest.raises(JobError, match="no preference row came of the selection: nothing to export"):
        _export(small_run, tmp_path, form="preference", where="n_failed_calls = 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
