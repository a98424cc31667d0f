"""Dataset layouts: each of the five is read off the columns; anything else is a precise error."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.config import PromptStyle
from cleaner.engine.collect.datasets import Layout, detect_layout, load_dataset
from cleaner.engine.collect.tasks import DatasetError

TESTS = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}

ROWS = {
    Layout.VERL: {"prompt": [{"role": "user", "content": "Q?"}], "reward_model": {"ground_truth": "4"},
                  "data_source": "math_dapo", "extra_info": {"index": 7}},
    Layout.AIME2024: {"ID": "2024-I-1", "Problem": "Q?", "Answer": 204, "Solution": "...", "data_source": "AIME2024"},
    Layout.AIME2025: {"problem": "Q?", "answer": "70", "data_source": "AIME2025"},
    Layout.GPQA_DIAMOND: {"problem": "Q? A) x B) y", "solution": "B", "domain": "Chemistry",
                          "data_source": "gpqa_diamond"},
    Layout.LIVECODEBENCH_V6: {"problem": "Add.", "ability": "Code",
                              "reward_model": json.dumps({"ground_truth": TESTS}),
                              "extra_info": json.dumps({"question_id": "abc"}), "data_source": "LiveCodeBench_v6"},
}
TRUTHS = {Layout.VERL: "4", Layout.AIME2024: "204", Layout.AIME2025: "70", Layout.GPQA_DIAMOND: "B",
          Layout.LIVECODEBENCH_V6: json.dumps(TESTS)}


def _write(tmp_path, rows, name="data.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("layout", list(Layout))
def test_each_layout_is_detected_and_read(tmp_path, layout):
    again = ROWS[layout] | ({"extra_info": {"index": 8}} if layout == Layout.VERL else {})  # ids are unique
    path = _write(tmp_path, [ROWS[layout], again])
    loaded = load_dataset(path, PromptStyle.BARE)
    assert loaded.layout == layout
    first, second = loaded.tasks
    source = ROWS[layout]["data_source"]
    assert first.ground_truth == TRUTHS[layout] and first.data_source == source
    prompt_ids = ["math_dapo-7", "math_dapo-8"] if layout == Layout.VERL else [f"{source}-0", f"{source}-1"]
    assert [first.prompt_id, second.prompt_id] == prompt_ids
    bare = {"Q?", "Q? A) x B) y", "Add."}
    assert first.messages[-1]["content"] in bare


def test_a_sixth_layout_names_the_file_the_columns_and_the_accepted_layouts(tmp_path):
    path = _write(tmp_path, [{"question": "Q?", "target": "1", "data_source": "mine"}], "mine.parquet")
    with pytest.raises(DatasetError) as error:
        load_dataset(path)
    message = str(error.value)
    assert "mine.parquet" in message and "['question', 'target', 'data_source']" in message
    for layout in Layout:
        assert str(layout) in message
    assert "livecodebench_v6 (problem, reward_model, data_source)" in message


def test_detection_prefers_the_most_specific_layout():
    assert detect_layout("f", ["problem", "answer", "solution", "domain", "data_source"]) == Layout.GPQA_DIAMOND
    assert detect_layout("f", ["problem", "answer", "data_source"]) == Layout.AIME2025


def test_bad_rows_name_the_file_row_and_expectation(tmp_path):
    path = _write(tmp_path, [ROWS[Layout.AIME2025], {**ROWS[Layout.AIME2025], "answer": ""}], "a25.parquet")
    with pytest.raises(DatasetError, match=r"a25\.parquet: row 1: expected a non-empty `answer`"):
        load_dataset(path)
    broken = {**ROWS[Layout.LIVECODEBENCH_V6], "reward_model": json.dumps({"inputs": []})}
    path = _write(tmp_path, [broken], "lcb.parquet")
    with pytest.raises(DatasetError, match=r"lcb\.parquet: row 0: expected `reward_model` as a JSON string"):
        load_dataset(path)
    uneven = {**ROWS[Layout.LIVECODEBENCH_V6],
              "reward_model": json.dumps({"ground_truth": {"inputs": ["1"], "outputs": []}})}
    with pytest.raises(DatasetError, match="as many string inputs as outputs"):
        load_dataset(_write(tmp_path, [uneven], "uneven.parquet"))


def test_text_that_is_not_utf8_names_the_row_and_column(tmp_path):
    """Parquet stores whatever bytes a writer gave a string column; the reader names the first
    row that is not UTF-8, in a nested column (verl's prompt messages) as in a flat one."""
    def text(values: list[bytes]) -> pa.Array:
        return pa.array(values, pa.binary()).view(pa.string())  # written as they are, unchecked

    messages = pa.StructArray.from_arrays([text([b"user"] * 3), text([b"fine", b"also fine", b"bad \xff here"])],
                                          ["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), messages)
    reward = pa.StructArray.from_arrays([pa.array(["1", "2", "3"])], ["ground_truth"])
    verl = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": prompt, "reward_model": reward, "data_source": ["toy"] * 3}), verl)
    with pytest.raises(DatasetError, match=r"^.*verl\.parquet: row 2: column `prompt` holds text that is not valid "
                                           r"UTF-8 \(byte 0xff at position 4 of a string\); the file's text must be "
                                           r"UTF-8$"):
        load_dataset(verl)
    aime = tmp_path / "aime.parquet"
    pq.write_table(pa.table({"problem": text([b"\xc3\x28 two"]), "answer": ["2"], "data_source": ["aime"]}), aime)
    with pytest.raises(DatasetError, match=r"aime\.parquet: row 0: column `problem` holds text that is not valid "
                                           r"UTF-8 \(byte 0xc3 at position 0 "):
        load_dataset(aime)


def test_limit_takes_the_first_rows(tmp_path):
    path = _write(tmp_path, [ROWS[Layout.AIME2025]] * 5)
    assert len(load_dataset(path, limit=2).tasks) == 2
