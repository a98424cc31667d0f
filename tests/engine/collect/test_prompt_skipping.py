"""Prompts whose last group was settled (all correct or all wrong) are skipped for the next
iterations, chosen from what the warehouse holds and recorded (collect/job.py `iteration_tasks`)."""

from __future__ import annotations

import pytest

from cleaner.config import CollectConfig
from cleaner.engine.collect.job import iteration_tasks
from cleaner.errors import JobError
from cleaner.records import Rollout, Segment, SegmentKind, ToolStatus
from cleaner.warehouse import Warehouse
from tests.factories import write_toy_dataset


def _group(iteration: int, prompt_id: str, rewards, finish: str = "answer", infra: int | None = None):
    """A group of `prompt_id` at `iteration` with these rewards; `infra`: the sample whose call the
    sandbox failed."""
    rollouts, segments = [], []
    for sample, reward in enumerate(rewards):
        rollout_id = f"it{iteration}-{prompt_id}-s{sample}"
        rollouts.append(Rollout(rollout_id, iteration, f"it{iteration}-{prompt_id}", prompt_id, sample, "p", "toy",
                                "1", None, reward, reward > 0, finish, 0.5, "raw", "c", 1, 0, 0))
        segments.append(Segment(rollout_id, iteration, 0, SegmentKind.PROMPT, None, None, (1,), None, "q"))
        if sample == infra:
            segments.append(Segment(rollout_id, iteration, 1, SegmentKind.TOOL, 0, 0, (2,), None, "t",
                                    tool_status=ToolStatus.INFRA_ERROR))
    return rollouts, segments


def _write(warehouse: Warehouse, iteration: int, groups) -> None:
    rollouts = [r for rs, _ in groups for r in rs]
    segments = [s for _, ss in groups for s in ss]
    warehouse.write_rollouts(iteration, rollouts, segments)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "toy.parquet"
    write_toy_dataset(path, 8)
    return str(path)


def _ids(planned):
    return [task.prompt_id for task in planned[0]]


def _recorded(warehouse: Warehouse, config: CollectConfig) -> list[str]:
    """The prompts of the iteration's plan, recorded as collect records it before its first rollout."""
    tasks, plan = iteration_tasks(warehouse, config)
    warehouse.save_plan(config.iteration, plan)
    return [task.prompt_id for task in tasks]


def test_settled_prompts_are_skipped_and_the_next_ones_taken_in_their_place(tmp_path, data):
    warehouse = Warehouse(tmp_path / "w")
    first = CollectConfig(data=data, n_prompts=4, skip_settled_prompts=2)
    assert _recorded(warehouse, first) == ["toy-0", "toy-1", "toy-2", "toy-3"]
    _write(warehouse, 0, [_group(0, "toy-0", [1, 1]),  # all correct: settled
                          _group(0, "toy-1", [0, 1]),
                          _group(0, "toy-2", [0, 0]),  # all wrong: settled
                          _group(0, "toy-3", [1, 0, 0], infra=0)])  # the faulted sample has no say: settled
    second = CollectConfig(data=data, n_prompts=4, skip_settled_prompts=2, iteration=1)
    assert _recorded(warehouse, second) == ["toy-4", "toy-5", "toy-6", "toy-7"]
    _write(warehouse, 1, [_group(1, f"toy-{i}", [0, 1]) for i in (4, 5, 6, 7)])
    # iteration 2 walks on from row 0: toy-0, toy-2 and toy-3 settled at 0, within 2 iterations: skipped
    third = CollectConfig(data=data, n_prompts=4, skip_settled_prompts=2, iteration=2)
    assert _recorded(warehouse, third) == ["toy-1", "toy-4", "toy-5", "toy-6"]
    plan = warehouse.plan(2)
    assert plan.skipped == (("toy-0", 0), ("toy-2", 0), ("toy-3", 0)) and plan.next_row == 7


def test_a_skip_lasts_its_window_then_the_prompt_comes_back(tmp_path, data):
    warehouse = Warehouse(tmp_path / "w")
    _write(warehouse, 0, [_group(0, "toy-0", [1, 1])])
    window = CollectConfig(data=data, n_prompts=2, skip_settled_prompts=1, iteration=1)
    assert "toy-0" not in _ids(iteration_tasks(warehouse, window))  # 1 - 0 <= 1: skipped
    later = CollectConfig(data=data, n_prompts=8, skip_settled_prompts=1, iteration=2)
    assert "toy-0" in _ids(iteration_tasks(warehouse, later))  # 2 - 0 > 1: back
    forever = CollectConfig(data=data, n_prompts=8, skip_settled_prompts=-1, iteration=5)
    assert _ids(iteration_tasks(warehouse, forever)) == [f"toy-{i}" for i in range(1, 8)]  # 7 left of 8


def test_only_the_last_group_counts(tmp_path, data):
    warehouse = Warehouse(tmp_path / "w")
    _write(warehouse, 0, [_group(0, "toy-0", [1, 1])])
    _write(warehouse, 1, [_group(1, "toy-0", [0, 1])])  # no longer settled
    config = CollectConfig(data=data, n_prompts=8, skip_settled_prompts=-1, iteration=2)
    assert "toy-0" in _ids(iteration_tasks(warehouse, config))


def test_a_recorded_choice_is_read_back_whatever_the_warehouse_holds_since(tmp_path, data):
    warehouse = Warehouse(tmp_path / "w")
    config = CollectConfig(data=data, n_prompts=3, skip_settled_prompts=-1, iteration=1)
    chosen = _recorded(warehouse, config)
    _write(warehouse, 0, [_group(0, "toy-3", [1, 1])])  # settled after the choice: a resume keeps it
    assert _ids(iteration_tasks(warehouse, config)) == chosen == ["toy-3", "toy-4", "toy-5"]


def test_every_prompt_settled_is_one_error_and_toys_need_a_dataset(tmp_path, data):
    warehouse = Warehouse(tmp_path / "w")
    _write(warehouse, 0, [_group(0, f"toy-{i}", [1, 1]) for i in range(8)])
    with pytest.raises(JobError, match="every prompt's last group was settled"):
        iteration_tasks(warehouse, CollectConfig(data=data, n_prompts=4, skip_settled_prompts=-1, iteration=1))
    with pytest.raises(ValueError, match="skip_settled_prompts needs --data"):
        CollectConfig(skip_settled_prompts=2)
    with pytest.raises(ValueError, match="skip_settled_prompts must be >= 0, or -1"):
        CollectConfig(data=data, skip_settled_prompts=-2)


def test_off_is_the_plain_slice_and_keeps_the_config_id():
    assert CollectConfig().config_id == CollectConfig(skip_settled_prompts=0).config_id


@pytest.mark.slow
def test_a_run_never_collects_a_settled_prompt_again_and_a_rerun_takes_the_same_prompts(tmp_path):
    from typer.testing import CliRunner

    from cleaner.cli import app

    data = tmp_path / "toy.parquet"
    write_toy_dataset(data, 5)  # 3 prompts an iteration: the second iteration comes back to the first's
    chosen = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        result = CliRunner().invoke(app, ["run", "--run-dir", str(run_dir), "--data", str(data), "--prompt-style",
                                          "bare", "--prompts", "3", "--group-size", "2", "--iterations", "3",
                                          "--skip-settled-prompts", "-1", "--sandbox-workers", "1"])
        assert result.exit_code == 0, result.output
        warehouse = Warehouse(run_dir / "warehouse")
        rollouts = {i: warehouse.read_rollouts(i) for i in range(3)}
        settled_before: set[str] = set()
        for i in range(3):
            prompts = {r.prompt_id for r in rollouts[i]}
            assert len(prompts) == 3 and not prompts & settled_before  # never again, once settled
            for prompt in prompts:
                rewards = {r.reward for r in rollouts[i] if r.prompt_id == prompt}
                settled_before |= {prompt} if len(rewards) == 1 else set()
        plans = [warehouse.plan(i) for i in range(3)]
        assert any(plan.skipped for plan in plans)  # the run did meet a settled prompt again
        chosen.append([plan.prompt_ids for plan in plans])
    assert chosen[0] == chosen[1]
