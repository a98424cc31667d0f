"""Toy tasks are deterministic and right; verl-style Parquet loads or fails with a precise message."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.config import PromptStyle
from cleaner.engine.collect.tasks import DatasetError, Task, load_rl_parquet, toy_tasks

# ---------------------------------------------------------------------------------------------
# Toy family


def test_toy_tasks_are_deterministic_in_n_and_seed():
    assert toy_tasks(20, seed=3) == toy_tasks(20, seed=3)
    assert toy_tasks(20, seed=3)[:5] == toy_tasks(5, seed=3)
    assert toy_tasks(5, seed=3) != toy_tasks(5, seed=4)
    assert [t.prompt_id for t in toy_tasks(3, seed=7)] == ["toy-7-0", "toy-7-1", "toy-7-2"]


def test_toy_ground_truth_is_the_value_of_the_question():
    for task in toy_tasks(200, seed=0):
        assert task.data_source == "toy"
        (message,) = task.messages
        assert message["role"] == "user"
        a, b, c, d = map(int, re.findall(r"\d+", message["content"]))
        assert 100 <= a <= 999 and 100 <= b <= 999 and 100 <= c <= 999 and 11 <= d <= 97
        assert task.ground_truth == str((a * b + c) % d)


def test_toy_tasks_rejects_negative_n():
    with pytest.raises(ValueError, match="n must be >= 0"):
        toy_tasks(-1, seed=0)


# ---------------------------------------------------------------------------------------------
# verl-style RL Parquet


def _row(question: str, truth, source: str = "math_dapo", index: int = 0) -> dict:
    return {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "data_source": source,
        "extra_info": {"index": index, "split": "train"},
    }


def test_load_rl_parquet_reads_the_open_agentrl_layout(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+1?", "2", index=10), _row("2+2?", "4", "aime", 11)]), path)
    tasks = load_rl_parquet(path, prompt_style=PromptStyle.BARE)
    assert tasks == [
        Task("math_dapo-10", ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}),
             "2", "math_dapo", source_row=0,  # the id carries extra_info's index; errors name the row
             extra_info={"index": 10, "split": "train"}),  # a reward function gets the row's extra_info
        Task("aime-11", ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}),
             "4", "aime", source_row=1, extra_info={"index": 11, "split": "train"}),
    ]
    assert len(load_rl_parquet(path, limit=1)) == 1


def test_missing_column_names_the_file_and_the_column(tmp_path):
    path = tmp_path / "nodata.parquet"
    rows = [_row("1+1?", "2")]
    del rows[0]["data_source"]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"nodata\.parquet.*missing column.*data_source"):
        load_rl_parquet(path)


def test_bad_row_names_the_file_the_row_and_the_expectation(tmp_path):
    path = tmp_path / "bad.parquet"
    rows = [_row("1+1?", "2"), _row("2+2?", None)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: expected .*ground_truth"):
        load_rl_parquet(path)


def test_empty_prompt_row_is_rejected(tmp_path):
    path = tmp_path / "empty.parquet"
    rows = [_row("1+1?", "2")]
    rows[0]["prompt"] = []
    schema = pa.Table.from_pylist([_row("x", "1")]).schema
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    with pytest.raises(ValueError, match=r"row 0: expected `prompt` as a non-empty list"):
        load_rl_parquet(path)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable Parquet file"):
        load_rl_parquet(path)
    with pytest.raises(ValueError, match="no such Parquet file"):
        load_rl_parquet(tmp_path / "absent.parquet")


def test_reference_style_edits_the_first_message_whatever_its_role(tmp_path):
    """The reference appends to `prompt[0]`; here a system message."""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+1?", "2")]), path)
    (task,) = load_rl_parquet(path)
    system, user = task.messages
    assert system["content"].startswith("Be brief.\nDo not put units") and user["content"] == "1+1?"


def test_verl_files_of_evaluation_sources_keep_their_built_prompts(tmp_path):
    path = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([_row("Built prompt.", "7", "AIME2024")]), path)
    assert load_rl_parquet(path) == load_rl_parquet(path, prompt_style=PromptStyle.BARE)


def test_a_ground_truth_reaches_a_reward_function_as_the_row_held_it(tmp_path):
    """verl hands `reward_model.ground_truth` over as it is (a struct, a list, a number); it is stored
    as JSON text, and the built-in grader takes a list's first item as the accepted answer."""
    tests = {"inputs": ["1\n"], "outputs": ["2\n"]}
    files = {"number": 42, "list": ["3/4", "0.75"], "struct": tests, "text": "x^2"}
    tasks = {}
    for name, truth in files.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist([_row("Q?", truth, "lcb_code" if name == "struct" else "math_dapo")]),
                       path)
        (tasks[name],) = load_rl_parquet(path)
    assert [tasks[name].raw_truth for name in files] == [42, ["3/4", "0.75"], tests, "x^2"]
    assert [tasks[name].ground_truth for name in files] == [
        "42", '["3/4", "0.75"]', '{"inputs": ["1\\n"], "outputs": ["2\\n"]}', "x^2"]
    assert [tasks[name].graded_truth for name in files] == ["42", "3/4", tasks["struct"].ground_truth, "x^2"]
    assert tasks["text"].truth is None  # a string row is what it always was


@pytest.mark.parametrize(("truth", "shown"), [
    ("", "''"), ([], r"\[\]"), (float("nan"), "nan"), ([[1]], r"\[\[1\]\]"), (True, "True")])
def test_an_unusable_ground_truth_names_the_row(tmp_path, truth, shown):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([_row("Q?", truth)]), path)  # a column holds one type
    with pytest.raises(ValueError, match=rf"bad\.parquet: row 0: expected a non-empty `reward_model.ground_truth`.*"
                                         rf"got {shown}"):
        load_rl_parquet(path)


def test_the_built_in_grader_refuses_a_struct_it_cannot_read():
    """A math row whose ground truth is a struct needs the user's reward function: one line before
    any rollout, naming the row and the flag."""
    from cleaner.config import CollectConfig
    from cleaner.engine.collect.job import UserCode
    from cleaner.errors import JobError

    for truth in ({"a": 1}, [{"a": 1}]):  # a struct, or a list whose first answer is one
        task = Task("math_dapo-7", ({"role": "user", "content": "?"},), "{}", "math_dapo", 3, truth=truth)
        with pytest.raises(JobError, match=r"^math_dapo-7 \(row 3\): its ground truth is a struct, which the "
                                           r"built-in grader cannot compare an answer with; .*--reward-fn"):
            UserCode(None, None).grading([task], CollectConfig())


def test_rows_sharing_a_prompt_id_are_refused_at_load_naming_them(tmp_path):
    path = tmp_path / "train.parquet"
    rows = [_row("1+1?", "2", index=0), _row("2+2?", "4", index=1), _row("3+3?", "6", index=0),
            _row("4+4?", "8", "aime", index=0), _row("5+5?", "10", index=1)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError) as raised:
        load_rl_parquet(path)
    assert str(raised.value) == (
        f"{path}: 2 row(s) repeat another row's prompt id (data_source and extra_info.index): rows 0 and 2 "
        "('math_dapo-0'), rows 1 and 4 ('math_dapo-1'); each row's id names its GRPO group and must be unique: "
        "give every row its own extra_info.index")


def test_each_repeat_of_a_prompt_id_is_named_with_the_row_that_first_held_it(tmp_path):
    """Rows 0, 2, 3 and 5 all hold index 4: each repeat is named beside row 0, the row that first
    held the id; past three repeats the rest are counted."""
    path = tmp_path / "train.parquet"
    rows = [_row(f"{n}+{n}?", str(2 * n), index=4 if n in (0, 2, 3, 5) else 10 + n) for n in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError) as raised:
        load_rl_parquet(path)
    assert str(raised.value).startswith(
        f"{path}: 3 row(s) repeat another row's prompt id (data_source and extra_info.index): rows 0 and 2 "
        "('math_dapo-4'), rows 0 and 3 ('math_dapo-4'), rows 0 and 5 ('math_dapo-4'); ")
    rows += [_row("6+6?", "12", index=11)]  # a repeat of row 1: counted, not shown
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"^.*: 4 row\(s\) .*rows 0 and 5 \('math_dapo-4'\) and 1 more; "):
        load_rl_parquet(path)


def test_collect_on_colliding_rows_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from cleaner.cli import app

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+1?", "2", index=7), _row("2+2?", "4", index=7)]), path)
    result = CliRunner().invoke(app, ["collect", "-w", str(tmp_path / "wh"), "--data", str(path), "--prompts", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "rows 0 and 1 ('math_dapo-7')" in line
    assert not list((tmp_path / "wh").rglob("*.parquet"))
