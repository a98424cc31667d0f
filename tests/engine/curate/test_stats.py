"""Pass statistics (cleaner/engine/curate/stats.py): the paper's JSON Lines format written and read back,
every line that is not the format refused with its file and line, and the key shared by a warehouse
prompt and its dataset row."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.config import PromptStyle
from cleaner.engine.collect.tasks import DatasetError, load_rl_parquet
from cleaner.engine.curate.stats import (
    PromptStats,
    StatsError,
    dataset_uids,
    pooled,
    read_stats,
    uid_of,
    write_lines,
)
from tests.factories import stats_line, verl_row

# The first line of the paper's shipped file (Open-AgentRL-30K.filtered.parquet.success.jsonl)
SHIPPED = ('{"uid": "0", "data_source": "math_dapo", "successes": 1, "attempts": 8, "success_rate": 0.125, '
           '"avg_score": 0.125, "keep": true}')


def test_a_line_is_written_as_the_paper_ships_its_own():
    assert write_lines([PromptStats("0", "math_dapo", 1, 8, 0.125)]) == SHIPPED + "\n"
    # keep as the shipped file has it: success_rate < 1
    assert '"keep": false' in write_lines([PromptStats("1", "math_dapo", 8, 8, 1.0)])


def test_the_papers_line_and_ours_read_back_the_same(tmp_path):
    path = tmp_path / "stats.jsonl"
    ours = [PromptStats("0", "math_dapo", 1, 8, 0.125), PromptStats("7", None, 3, 4, 0.5),
            PromptStats("x-2", "lcb_code", 0, 3, 0.0)]
    path.write_text(SHIPPED + "\n\n" + write_lines(ours[1:]))  # a blank line is skipped
    read = read_stats(path)
    assert [(s.uid, s.data_source, s.successes, s.attempts, s.avg_score) for s in read] == [
        (s.uid, s.data_source, s.successes, s.attempts, s.avg_score) for s in ours]
    assert [s.line for s in read] == [1, 3, 4]


def test_an_integer_uid_and_a_missing_data_source_read_as_the_reference_reads_them(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text('{"uid": 12, "successes": 0, "attempts": 8, "success_rate": 0.0, "avg_score": -1.0, '
                    '"keep": true}\n')
    (item,) = read_stats(path)
    assert (item.uid, item.data_source, item.avg_score) == ("12", "unknown", -1.0)


def test_a_line_without_attempts_has_no_rate(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text(stats_line("0", 0, 0) + "\n")
    assert read_stats(path)[0].rate is None


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2: not a JSON object"),
    ("[1, 2]", "line 2: expected a JSON object with uid, data_source, successes, attempts, success_rate, "
               "avg_score, keep, got list"),
    ('{"uid": "1", "successes": 1}', "line 2: missing attempts, success_rate, avg_score, keep"),
    (stats_line("1", 1, 8, uid=None), "line 2: `uid` must be a string or an integer, got None"),
    (stats_line("1", 1, 8, data_source=3), "line 2: `data_source` must be a string, got 3"),
    (stats_line("1", 1, 8, successes="1"), "line 2: `successes` must be an integer >= 0, got '1'"),
    (stats_line("1", 1, 8, attempts=-8), "line 2: `attempts` must be an integer >= 0, got -8"),
    (stats_line("1", 9, 8), "line 2: `successes` must be at most attempts (8), got 9"),
    (stats_line("1", 1, 8, success_rate=0.25), "line 2: `success_rate` must be successes / attempts (1/8), got 0.25"),
    (stats_line("1", 1, 8, avg_score="high"), "line 2: `avg_score` must be a finite number, got 'high'"),
    (stats_line("1", 1, 8, keep="yes"), "line 2: `keep` must be true or false, got 'yes'"),
    (stats_line("0", 2, 8), "line 2: uid '0' of data source 'math' is already on line 1"),
])
def test_a_line_that_is_not_the_format_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "stats.jsonl"
    path.write_text(stats_line("0", 1, 8) + "\n" + line + "\n")
    with pytest.raises(StatsError) as caught:
        read_stats(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


def test_one_uid_of_two_data_sources_is_two_prompts(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text(stats_line("0", 1, 8, "math") + "\n" + stats_line("0", 2, 8, "code") + "\n")
    assert [s.data_source for s in read_stats(path)] == ["math", "code"]


def test_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(StatsError, match="the file holds no statistics"):
        read_stats(tmp_path / "empty.jsonl")
    with pytest.raises(StatsError, match="no such file"):
        read_stats(tmp_path / "absent.jsonl")


# ---------------------------------------------------------------------------------------------
# The key


def test_a_prompt_id_is_its_data_source_and_its_uid():
    assert uid_of("math_dapo-17", "math_dapo") == "17"
    assert uid_of("train-code-taco-easy-3", "train-code-taco-easy") == "3"
    assert uid_of("toy-0-5", "toy") == "0-5"
    assert uid_of("other-1", "math") == "other-1"  # not the loader's form: the id as it is


def test_the_warehouse_key_is_the_dataset_key_for_every_row_the_loader_reads(tmp_path):
    """The loader's prompt id (collect/tasks.py) and curate's dataset key name the same row: with
    extra_info.index, and without it (the row's position)."""
    path = tmp_path / "d.parquet"
    rows = [verl_row("1+1?", "2", "math_dapo", extra_info={"index": 40}), verl_row("2+2?", "4", "aime", extra_info={}),
            verl_row("3+3?", "6", "aime", extra_info={"index": 7}), verl_row("4+4?", "8", "aime", extra_info={})]
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_rl_parquet(path, prompt_style=PromptStyle.BARE)
    keys = dataset_uids(path, [row["extra_info"] for row in rows], None)
    assert keys == ["40", "1", "7", "3"]
    assert [uid_of(task.prompt_id, task.data_source) for task in tasks] == keys


def test_a_uid_column_is_the_key_where_the_dataset_has_one(tmp_path):
    path = Path("d.parquet")
    assert dataset_uids(path, [{"index": 1}, {"index": 2}], [10, "b"]) == ["10", "b"]
    with pytest.raises(DatasetError, match=r"^d.parquet: row 1: expected a non-null `uid`, got None"):
        dataset_uids(path, [{}, {}], ["a", None])


def test_pooled_statistics_are_the_decided_rollouts():
    stats = pooled("math-3", "math", successes=3, attempts=4, reward_sum=2.5)
    assert (stats.uid, stats.successes, stats.attempts, stats.avg_score) == ("3", 3, 4, 0.625)
    assert pooled("math-3", "math", successes=0, attempts=0, reward_sum=0.0) is None  # only infrastructure faults
