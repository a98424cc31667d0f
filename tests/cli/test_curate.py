"""`cleaner curate` from the command line (docs/curate.md): every bad input one `error:` line, exit code 1,
nothing written; and a toy warehouse round trip, collect -> curate -> collect (and run) on the output."""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.warehouse import Warehouse
from tests.factories import stats_line, verl_row

runner = CliRunner()
TINY = ["--prompt-style", "bare", "--sandbox-workers", "1"]


def _fails_cleanly(tmp_path: Path, args: list[str], *expected: str) -> str:
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    result = runner.invoke(app, ["curate", *args])
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and output.count("error:") == 1, result.output
    assert output.startswith("error: ")
    for text in expected:
        assert text in output, (text, output)
    assert sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*")) == before  # nothing written
    return output


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    """A dataset of four rows (uids 0..3, two code) and statistics of them, eight attempts each."""
    data = tmp_path / "d.parquet"
    rows = [verl_row(f"{i}?", str(i), "taco" if i < 2 else "math", index=i) for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    stats = tmp_path / "s.jsonl"
    stats.write_text("".join(stats_line(str(i), i, 8, "taco" if i < 2 else "math") + "\n" for i in range(4)))
    return {"data": str(data), "stats": str(stats), "out": str(tmp_path / "o.parquet")}


def _filter(files: dict[str, str], *more: str) -> list[str]:
    return ["--stats", files["stats"], "--data", files["data"], "--out", files["out"], *more]


@pytest.mark.parametrize(("spec", "message"), [
    ("0.0:0.5,0.3", "--success-rate-ratios '0.0:0.5,0.3': '0.3' is not RATE:RATIO"),
    ("0.0:many", "ratio 'many' is not a number"),
    ("0.0:1.2", "ratio 1.2 is outside [0, 1]"),
    ("0.25:1,0.250:0", "success rate 0.25 is named twice"),
    ("0.3:0.5", "0.3 is not a success rate of these statistics (within 0.001 of j/n for their attempts per "
                "prompt n = 8)"),
    ("1.5:0.5", "success rate 1.5 is outside [0, 1]"),
    ("1,1,1", "the short form takes exactly nine ratios"),
])
def test_bad_ratios(tmp_path, files, spec, message):
    _fails_cleanly(tmp_path, _filter(files, "--success-rate-ratios", spec), message)


def test_the_nine_value_form_is_refused_for_rates_that_are_not_eighths(tmp_path, files):
    Path(files["stats"]).write_text(stats_line("0", 1, 3) + "\n")
    _fails_cleanly(tmp_path, _filter(files, "--success-rate-ratios", "1,1,1,1,1,1,1,1,1"),
                   "the statistics hold rate 1/3")


def test_statistics_of_no_prompt_of_the_dataset(tmp_path, files):
    Path(files["stats"]).write_text(stats_line("40", 1, 8) + "\n" + stats_line("41", 1, 8) + "\n")
    _fails_cleanly(tmp_path, _filter(files), f"--data {files['data']}: none of its rows has statistics in file "
                                            f"{files['stats']} (2 prompts)")


def test_a_statistics_line_that_is_not_the_format(tmp_path, files):
    with open(files["stats"], "a") as file:
        file.write('{"uid": "9", "successes": 1}\n')
    _fails_cleanly(tmp_path, _filter(files), f"{files['stats']}: line 5: missing attempts, success_rate, avg_score, keep")


def test_a_dataset_that_is_not_verls_layout(tmp_path, files):
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), files["data"])
    _fails_cleanly(tmp_path, _filter(files), f"{files['data']}: missing column(s) ['prompt', 'reward_model', "
                                            "'data_source']; expected")
    pq.write_table(pa.Table.from_pylist([verl_row("1?", "1", index=0) | {"prompt": "not messages"}]), files["data"])
    _fails_cleanly(tmp_path, _filter(files), f"{files['data']}: row 0: expected `prompt` as a non-empty list")


def test_missing_inputs(tmp_path, files):
    _fails_cleanly(tmp_path, ["--stats", str(tmp_path / "none.jsonl"), "--data", files["data"], "--out", files["out"]],
                   "none.jsonl: no such file")
    _fails_cleanly(tmp_path, ["--stats", files["stats"], "--data", str(tmp_path / "none.parquet"), "--out",
                              files["out"]], "none.parquet: no such Parquet file")


def test_an_existing_out_and_one_inside_the_warehouse(tmp_path, files):
    Path(files["out"]).write_text("mine")
    _fails_cleanly(tmp_path, _filter(files), f"--out {files['out']}: {files['out']} exists; pass --overwrite")
    _fails_cleanly(tmp_path, _filter(files, "--overwrite"), "will not replace it: curate did not write it")
    inside = tmp_path / "wh" / "curated.parquet"
    (tmp_path / "wh").mkdir()
    _fails_cleanly(tmp_path, ["-w", str(tmp_path / "wh"), "--stats", files["stats"], "--data", files["data"],
                              "--out", str(inside)], f"--out {inside} is inside the warehouse")


@pytest.mark.parametrize(("args", "message"), [
    (["--stats", "s.jsonl", "--iteration", "0", "--stats-out", "x.jsonl"],
     "invalid option: give statistics from a file (--stats) or from the warehouse (--iteration, --eval), not both"),
    (["--iteration", "0"], "invalid option: nothing to write"),
    (["--iteration", "0", "--out", "o.parquet"], "invalid option: --out needs --data"),
    (["--stats", "s.jsonl", "--stats-out", "x.jsonl"], "--stats-out writes a warehouse's statistics"),
    (["--iteration", "0", "--stats-out", "x.jsonl", "--retain-code"], "give --out too"),
    (["--iteration", "zero", "--stats-out", "x.jsonl"], "--iteration takes comma-separated iteration numbers"),
    (["--iteration", "0,0", "--stats-out", "x.jsonl"], "--iteration must be distinct"),
    (["--iteration", "0", "--stats-out", "x.jsonl", "--seed", "-1"], "invalid option: --seed must be in [0, 4294966294]"),
])
def test_options_that_do_not_go_together(tmp_path, args, message):
    _fails_cleanly(tmp_path, ["-w", str(tmp_path / "wh"), *args], message)


def test_an_iteration_not_in_the_warehouse(tmp_path):
    Warehouse(tmp_path / "wh").root.mkdir()
    _fails_cleanly(tmp_path, ["-w", str(tmp_path / "wh"), "--iteration", "3", "--stats-out", str(tmp_path / "s.jsonl")],
                   "iteration 3 is not collected (collected: none)")


def test_the_filter_prints_the_counts_and_writes_them_beside_the_output(tmp_path, files):
    # rates 0/8 .. 3/8, rows 0 and 1 code: 0/8 dropped; --retain-code keeps code row 1 (1/8) whole
    result = runner.invoke(app, ["curate", *_filter(files, "--success-rate-ratios", "0:0,0.125:0,0.25:1",
                                                    "--retain-code")])
    assert result.exit_code == 0, result.output
    kept = [row["extra_info"]["index"] for row in pq.read_table(files["out"]).to_pylist()]
    assert kept == [1, 2, 3]
    assert "| 0.125 (1/8) | 1 | 1 | 0 | 1 | 1 (100.0%) | 0 (0.0%) | - | - |" in result.output
    summary = json.loads(Path(files["out"] + ".curate.json").read_text())
    assert summary["kept"] == 3 and summary["retain_code"] is True and summary["seed"] == 42


# ---------------------------------------------------------------------------------------------
# The toy round trip: collect -> curate -> collect, and run, on the output


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, Path]:
    """The toy problems in verl's layout (uid = extra_info.index), collected by the tiny policy: 8
    prompts x 4 rollouts."""
    root = tmp_path_factory.mktemp("curate")
    data = root / "toy.parquet"
    rows = [verl_row(task.messages[0]["content"], task.ground_truth, "toy", index=i)
            for i, task in enumerate(toy_tasks(8, 0))]
    pq.write_table(pa.Table.from_pylist(rows), data)
    result = runner.invoke(app, ["collect", "-w", str(root / "wh"), "--data", str(data), "--prompts", "8",
                                 "--group-size", "4", *TINY])
    assert result.exit_code == 0, result.output
    return {"root": root, "data": data, "wh": root / "wh"}


def test_a_collected_iteration_curates_a_dataset_collect_reads(collected):
    root, wh = collected["root"], collected["wh"]
    out, stats = root / "curated.parquet", root / "stats.jsonl"
    result = runner.invoke(app, ["curate", "-w", str(wh), "--iteration", "0", "--stats-out", str(stats),
                                 "--data", str(collected["data"]), "--success-rate-ratios", "1.0:0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # by hand from the stored rollouts: each prompt's rate, then floor(count x 0.5) of the all-correct
    rollouts = Warehouse(wh).read_rollouts(0)
    rates = {prompt: Fraction(sum(r.correct for r in rollouts if r.prompt_id == prompt), 4)
             for prompt in {r.prompt_id for r in rollouts}}
    assert [json.loads(line)["uid"] for line in stats.read_text().splitlines()] == [str(i) for i in range(8)]
    assert {f"toy-{line['uid']}": Fraction(line["successes"], line["attempts"])
            for line in map(json.loads, stats.read_text().splitlines())} == rates
    per_rate = Counter(rates.values())
    expected = sum(count for rate, count in per_rate.items() if rate != 1) + per_rate[Fraction(1)] // 2
    kept = pq.read_table(out).to_pylist()
    assert len(kept) == expected
    kept_ids = [f"toy-{row['extra_info']['index']}" for row in kept]
    assert kept_ids == sorted(kept_ids, key=lambda prompt: int(prompt.split("-")[1]))  # the dataset's order
    again = runner.invoke(app, ["collect", "-w", str(root / "wh2"), "--data", str(out), "--prompts", str(len(kept)),
                                "--group-size", "1", *TINY])
    assert again.exit_code == 0, again.output
    assert sorted(r.prompt_id for r in Warehouse(root / "wh2").read_rollouts(0)) == sorted(kept_ids)


@pytest.mark.slow
def test_run_trains_on_a_curated_dataset(collected):
    root = collected["root"]
    out = root / "for-run.parquet"
    result = runner.invoke(app, ["curate", "-w", str(collected["wh"]), "--iteration", "0", "--data",
                                 str(collected["data"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    run = runner.invoke(app, ["run", "--run-dir", str(root / "run"), "--data", str(out), "--prompts", "2",
                              "--group-size", "2", "--iterations", "1", *TINY])
    assert run.exit_code == 0, run.output
    assert Warehouse(root / "run" / "warehouse").read_iterations()[0].iteration == 0
