"""The curate job (cleaner/engine/curate/job.py) on hand-built warehouses and datasets: statistics pooled
over iterations and an evaluation with infrastructure faults left out, the completeness check purify
makes, the output's columns, order and summaries, and what may be replaced."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.config import CollectConfig, CurateConfig, PromptStyle
from cleaner.engine.collect.tasks import load_rl_parquet
from cleaner.engine.curate.job import curate_job
from cleaner.engine.purify.pipeline import infra_fault
from cleaner.errors import CleanerError
from cleaner.warehouse import Warehouse
from cleaner.warehouse.pass_rates import prompt_outcomes
from tests.factories import make_eval_run, prompt_rollout, stats_line, tool_chain, verl_row


def _chain(rollout_id: str, iteration: int, statuses: tuple[str, ...] = ("ok",)):
    return [dataclasses.replace(s, rollout_id=rollout_id, iteration=iteration) for s in tool_chain(rollout_id, statuses)]


def pooled_warehouse(root: Path) -> Warehouse:
    """math-0: iteration 0 has 3 of 4 correct, iteration 1 has 1 of 4 correct plus one rollout whose
    generation failed (finish_reason error); math-1: iteration 0, 2 of 4 correct, one of the wrong
    ones ended by a call that kept failing with infra_error; the evaluation e1 adds 2 of 2 correct
    to math-1; aime-0: its only rollout an infrastructure fault. Rewards are 1/0 but math-1's
    iteration-0 correct ones score 0.5."""
    wh = Warehouse(root)
    it0 = [prompt_rollout("math-0", 0, s, s < 3) for s in range(4)]
    it0 += [prompt_rollout("math-1", 0, s, s < 2, reward=0.5 if s < 2 else 0.0) for s in range(4)]
    segments = [seg for r in it0 for seg in _chain(r.rollout_id, 0, ("infra_error",) if r.rollout_id == "it0-math-1-s3"
                                                    else ("error", "ok"))]
    wh.write_rollouts(0, it0, segments)
    it1 = [prompt_rollout("math-0", 1, s, s == 0) for s in range(4)]
    it1 += [prompt_rollout("math-0", 1, 4, False, finish_reason="error"), prompt_rollout("aime-0", 1, 0, True,
                                                                                        data_source="aime",
                                                                                        finish_reason="error")]
    wh.write_rollouts(1, it1, [seg for r in it1 for seg in _chain(r.rollout_id, 1)])
    ev = [prompt_rollout("math-1", 0, s, True, eval_id="e1") for s in range(2)]
    wh.write_eval_batch("e1", ev, [seg for r in ev for seg in _chain(r.rollout_id, 0)])
    wh.write_eval_run(make_eval_run("e1", True))
    return wh


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_statistics_pool_iterations_and_evaluations_without_infrastructure_faults(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    out = tmp_path / "stats.jsonl"
    outcome = curate_job(wh, CurateConfig(iterations=(0, 1), evals=("e1",), stats_out=str(out)))
    # math-0: 3 + 1 correct of 4 + 4 decided (the failed generation left out); math-1: 2 + 2 of
    # 3 + 2 (the infra_error rollout left out), rewards 0.5 + 0.5 + 0 + 1 + 1 = 3.0 over 5;
    # aime-0: no decided rollout, no statistics
    assert _lines(out) == [
        {"uid": "0", "data_source": "math", "successes": 4, "attempts": 8, "success_rate": 0.5, "avg_score": 0.5,
         "keep": True},
        {"uid": "1", "data_source": "math", "successes": 4, "attempts": 5, "success_rate": 0.8, "avg_score": 0.6,
         "keep": True}]
    assert "16 rollouts, 3 ended by an infrastructure fault left out" in outcome.stats_page
    assert "without statistics: 1" in outcome.stats_page


def test_the_sql_leaves_out_the_rollouts_purify_calls_infrastructure_faults(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    faulted = {(r.prompt_id, r.iteration): 0 for i in (0, 1) for r in wh.read_rollouts(i)}
    for i in (0, 1):
        segments = wh.read_segments(i)
        for rollout in wh.read_rollouts(i):
            mine = [s for s in segments if s.rollout_id == rollout.rollout_id]
            faulted[(rollout.prompt_id, i)] += infra_fault(rollout, mine)  # purify's own rule
    by_prompt = {o.prompt_id: o.faults for o in prompt_outcomes(wh.connect(), [0, 1], [])}
    assert by_prompt == {"aime-0": 1, "math-0": faulted[("math-0", 0)] + faulted[("math-0", 1)],
                         "math-1": faulted[("math-1", 0)]} == {"aime-0": 1, "math-0": 1, "math-1": 1}


def test_an_iteration_not_collected_or_incomplete_or_being_collected_is_refused(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    stats_out = str(tmp_path / "s.jsonl")
    with pytest.raises(CleanerError, match=r"iteration 2 is not collected \(collected: 0, 1\)"):
        curate_job(wh, CurateConfig(iterations=(2,), stats_out=stats_out))
    planned = CollectConfig(n_prompts=3, group_size=2)  # toy prompts: none of them stored
    wh.save_collect_config(1, planned.to_json())
    with pytest.raises(CleanerError, match="iteration 1 holds 0 of the 6 rollouts its collection planned"):
        curate_job(wh, CurateConfig(iterations=(1,), stats_out=stats_out))
    with wh.writer("collect", 0), pytest.raises(CleanerError, match="iteration 0 is being collected"):
        curate_job(wh, CurateConfig(iterations=(0,), stats_out=stats_out))
    assert not Path(stats_out).exists()


def test_an_evaluation_without_its_eval_runs_row_is_refused(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    ev = [prompt_rollout("math-1", 0, 0, True, eval_id="e2")]
    wh.write_eval_batch("e2", ev, _chain(ev[0].rollout_id, 0))
    with pytest.raises(CleanerError, match="evaluation 'e2' has no eval_runs row: it is not stored, or not complete "
                                           r"\(its rollouts are stored"):
        curate_job(wh, CurateConfig(evals=("e2",), stats_out=str(tmp_path / "s.jsonl")))


# ---------------------------------------------------------------------------------------------
# The filtered dataset


def dataset(path: Path, n: int = 6) -> Path:
    """Rows 0..n-1 of verl's layout with a column of the user's own and file metadata."""
    rows = [verl_row(f"{i}+1?", str(i + 1), "math" if i % 2 else "taco", index=i, level=f"L{i}") for i in range(n)]
    table = pa.Table.from_pylist(rows).replace_schema_metadata({"origin": "hand-built"})
    pq.write_table(table, path)
    return path


def test_the_output_keeps_every_column_the_rows_order_and_the_files_metadata(tmp_path):
    data = dataset(tmp_path / "d.parquet")
    stats = tmp_path / "s.jsonl"
    # rows 0..4 have statistics (row 5 none; uid 77 no row); rates 0 and 1 dropped; row 4's statistics
    # name another data source, and match by uid alone, as the reference matches
    stats.write_text("\n".join([stats_line("4", 1, 2, "math"), stats_line("1", 0, 2, "math"),
                                stats_line("2", 2, 2, "taco"), stats_line("3", 1, 2, "math"),
                                stats_line("0", 1, 2, "taco"), stats_line("77", 1, 2, "math")]) + "\n")
    out = tmp_path / "o.parquet"
    outcome = curate_job(Warehouse(tmp_path / "wh"), CurateConfig(stats=str(stats), data=str(data), out=str(out),
                                                                   success_rate_ratios="0:0,1:0"))
    written, original = pq.read_table(out), pq.read_table(data)
    assert written.schema == original.schema and written.schema.metadata == {b"origin": b"hand-built"}
    assert written.to_pylist() == [original.to_pylist()[i] for i in (0, 3, 4)]
    assert [task.prompt_id for task in load_rl_parquet(out, prompt_style=PromptStyle.BARE)] == [
        "taco-0", "math-3", "taco-4"]
    assert outcome.kept == 3 and not (tmp_path / "wh").exists()  # the warehouse was not touched
    summary = json.loads(Path(f"{out}.curate.json").read_text())
    assert (summary["rows"], summary["rows_with_statistics"], summary["rows_without_statistics"],
            summary["statistics_without_row"], summary["kept"]) == (6, 5, 1, 1, 3)
    page = Path(f"{out}.curate.md").read_text()
    assert page == outcome.page and page.startswith("# cleaner curate\n")
    assert "rows with statistics: 5; without (dropped, as the paper's filter drops them): 1; statistics of no row " \
           "of the dataset: 1" in page


def test_an_existing_output_is_replaced_only_with_overwrite_and_only_if_curate_wrote_it(tmp_path):
    data = dataset(tmp_path / "d.parquet")
    stats = tmp_path / "s.jsonl"
    stats.write_text(stats_line("1", 1, 2) + "\n")
    out = tmp_path / "o.parquet"
    config = CurateConfig(stats=str(stats), data=str(data), out=str(out))
    curate_job(Warehouse(tmp_path / "wh"), config)
    with pytest.raises(CleanerError, match="exists; pass --overwrite"):
        curate_job(Warehouse(tmp_path / "wh"), config)
    again = dataclasses.replace(config, overwrite=True)
    curate_job(Warehouse(tmp_path / "wh"), again)  # its own: replaced
    out.write_bytes(pq.read_table(data).to_pandas().to_parquet())  # the user's file now
    before = out.read_bytes()
    with pytest.raises(CleanerError, match="will not replace it: curate did not write it"):
        curate_job(Warehouse(tmp_path / "wh"), again)
    assert out.read_bytes() == before


def test_an_output_inside_the_warehouse_is_refused(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    for config in (CurateConfig(iterations=(0,), stats_out=str(wh.root / "s.jsonl")),
                   CurateConfig(iterations=(0,), data=str(dataset(tmp_path / "d.parquet")),
                                out=str(wh.root / "x" / "o.parquet"))):
        with pytest.raises(CleanerError, match="is inside the warehouse"):
            curate_job(wh, config)
    assert not (wh.root / "s.jsonl").exists() and not (wh.root / "x").exists()


def test_an_existing_stats_out_is_replaced_only_if_it_is_statistics(tmp_path):
    wh = pooled_warehouse(tmp_path / "wh")
    out = tmp_path / "s.jsonl"
    out.write_text("my notes\n")
    config = CurateConfig(iterations=(0,), stats_out=str(out))
    with pytest.raises(CleanerError, match="exists; pass --overwrite"):
        curate_job(wh, config)
    with pytest.raises(CleanerError, match="will not replace it: it is not a statistics file"):
        curate_job(wh, dataclasses.replace(config, overwrite=True))
    assert out.read_text() == "my notes\n"
    out.write_text(stats_line("9", 1, 2) + "\n")
    curate_job(wh, dataclasses.replace(config, overwrite=True))
    assert [line["uid"] for line in _lines(out)] == ["0", "1"]


def test_statistics_from_the_warehouse_filter_as_their_file_does(tmp_path):
    """`-w W --iteration N --data D --out O` and `--stats-out F` then `--stats F --data D --out O`
    keep the same rows: one source of statistics, one filter."""
    wh = pooled_warehouse(tmp_path / "wh")
    data = dataset(tmp_path / "d.parquet")
    stats = tmp_path / "s.jsonl"
    direct = CurateConfig(iterations=(0, 1), evals=("e1",), data=str(data), out=str(tmp_path / "a.parquet"),
                          stats_out=str(stats), success_rate_ratios="0.5:0.0")
    curate_job(wh, direct)
    curate_job(wh, CurateConfig(stats=str(stats), data=str(data), out=str(tmp_path / "b.parquet"),
                                success_rate_ratios="0.5:0.0"))
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.to_pylist() == b.to_pylist() and [row["extra_info"]["index"] for row in a.to_pylist()] == [1]


def test_a_uid_column_other_than_collects_key_is_matched_and_said(tmp_path, caplog):
    wh = pooled_warehouse(tmp_path / "wh")  # statistics of uids 0 and 1 (math-0, math-1)
    data = tmp_path / "d.parquet"
    rows = [verl_row(f"{i}?", str(i), "math", index=i, uid=str(1 - i)) for i in range(2)]  # uid swapped
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "o.parquet"
    curate_job(wh, CurateConfig(iterations=(0, 1), evals=("e1",), data=str(data), out=str(out),
                                success_rate_ratios="0.5:0.0"))
    # uid "0" (row 1) is math-0's, at rate 1/2, dropped: row 0 (uid "1", math-1 at 4/5) stays
    assert [row["uid"] for row in pq.read_table(out).to_pylist()] == ["1"]
    assert "2 row(s) have a `uid` other than the key collect gave them" in caplog.text
