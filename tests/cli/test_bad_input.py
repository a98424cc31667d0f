"""Bad input, as a new user would try it: one `error:` line naming the input, exit code 1, no
traceback, nothing written; and the smallest runs work (typer's CliRunner)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY
from cleaner.errors import JobError
from cleaner.warehouse import Warehouse
from tests.factories import make_rollout, make_segments

runner = CliRunner()


def _fails_cleanly(args: list[str], *expected: str) -> str:
    result = runner.invoke(app, args)
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and output.count("error:") == 1, result.output
    for text in expected:
        assert text in output, (text, output)
    return output


SMALL = ["--prompts", "1", "--group-size", "1"]


def test_collect_with_a_missing_model_directory(tmp_path):
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--model", "/nonexistent", *SMALL],
                   "model '/nonexistent'", "no such directory", "config.json")
    assert not (tmp_path / "w").exists()  # nothing written


def test_collect_with_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--model", str(tmp_path / "empty"), *SMALL],
                   "has no config.json")


def test_collect_with_unreadable_data(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--data", str(bad), *SMALL],
                   "bad.parquet", "not a readable Parquet file")


def test_collect_with_text_that_is_not_utf8(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "latin1.parquet"
    problems = pa.array([b"1+1?", "caf\xe9 + 1?".encode("latin-1")], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"problem": problems, "answer": ["2", "3"], "data_source": ["aime"] * 2}), path)
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--data", str(path), *SMALL],
                   f"{path}: row 1: column `problem` holds text that is not valid UTF-8 (byte 0xe9 at position 3")
    assert not (tmp_path / "w").exists()


def test_collect_with_data_in_another_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), path)
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--data", str(path), *SMALL],
                   "other.parquet", "no known dataset layout has columns ['question', 'answer']",
                   "verl (prompt, reward_model, data_source)")


@pytest.mark.parametrize("device", ["cuda", "cuda:3", "nonsense"])
def test_unavailable_device(tmp_path, device):
    import torch

    if torch.cuda.is_available() and device != "nonsense" and torch.cuda.device_count() > 3:
        pytest.skip("this machine has that device")
    for command in (["collect", "-w", str(tmp_path / "w"), *SMALL],
                    ["run", "--run-dir", str(tmp_path / "r"), *SMALL]):
        _fails_cleanly([*command, "--device", device], f"device '{device}'")
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_purify_and_train_name_what_is_missing(tmp_path):
    _fails_cleanly(["purify", "-w", str(tmp_path / "none")], "iteration 0 has no rollouts", "cleaner collect")
    (tmp_path / "policy").mkdir()
    _fails_cleanly(["train", "-w", str(tmp_path / "none"), "--config-id", "abc", "--policy",
                    str(tmp_path / "policy"), "--out", str(tmp_path / "out")], "has no config.json")


def test_run_with_a_missing_model(tmp_path):
    _fails_cleanly(["run", "--run-dir", str(tmp_path / "r"), "--model", "./no/such/model", *SMALL],
                   "/no/such/model'", "no such directory")  # resolved, as it is stored
    assert not (tmp_path / "r").exists()


def test_a_model_that_is_a_file_names_the_directory_to_give(tmp_path):
    weights = tmp_path / "policy" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"")
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--model", str(weights), *SMALL],
                   f"model '{weights}': a file, not a directory", f"({weights.parent}?)")


@pytest.mark.parametrize(("flags", "message"), [
    (["--group-size", "1000000000"], "--prompts x --group-size must be at most 1,000,000 rollouts, "
                                     "got 64 x 1,000,000,000"),
    (["--prompts", "2000", "--group-size", "1000"], "got 2,000 x 1,000"),
])
def test_an_iteration_too_large_to_plan_is_refused_at_once(tmp_path, flags, message):
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), *flags], message)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("group_size", [1, 2])
def test_the_smallest_runs_complete(tmp_path, group_size):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--prompts", "1", "--group-size",
                                 str(group_size), "--iterations", "2", "--max-new-tokens", "48"])
    assert result.exit_code == 0, result.output
    connection = Warehouse(run_dir / "warehouse").connect()
    assert connection.sql("SELECT count(*) FROM iterations").fetchall() == [(2,)]
    assert connection.sql("SELECT count(*) FROM rollouts").fetchall() == [(2 * group_size,)]


no_sglang = pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None,
                               reason="sglang is installed here")


@no_sglang
@pytest.mark.parametrize("command", [
    ["collect", *SMALL], ["purify"], ["ablate"], ["run", "--iterations", "1", *SMALL],
])
def test_the_sglang_backend_without_sglang_names_the_extra(tmp_path, command):
    where = ["--run-dir", str(tmp_path / "r")] if command[0] == "run" else ["-w", str(tmp_path / "w")]
    _fails_cleanly([*command, *where, "--backend", "sglang"], "needs SGLang", "pip install 'cleaner[sglang]'")
    assert not (tmp_path / "w").exists() and not (tmp_path / "r" / "warehouse").exists()  # nothing written


def test_a_server_url_needs_the_sglang_backend(tmp_path):
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), *SMALL, "--sglang-url", "http://127.0.0.1:9"],
                   "invalid option: --sglang-url is for --backend sglang, got --backend 'torch'")
    _fails_cleanly(["purify", "-w", str(tmp_path / "w"), "--sglang-url", "http://127.0.0.1:9"],
                   "--sglang-url http://127.0.0.1:9 needs --backend sglang")



def _run_warehouse_copy(small_run, tmp_path) -> tuple[Warehouse, str]:
    """A copy of the small run's warehouse (purified rows of iteration 0), and their config id."""
    import shutil

    warehouse = Warehouse(shutil.copytree(small_run / "warehouse", tmp_path / "warehouse"))
    [(config_id,)] = warehouse.connect().sql("SELECT DISTINCT config_id FROM purified WHERE iteration = 0").fetchall()
    return warehouse, config_id


def test_train_out_never_replaces_a_warehouse_or_a_users_directory(small_run, tmp_path):
    """`train --out` at the warehouse itself, a directory holding a user's file, or a file: one
    error line, before any training (no train_steps written), each left byte for byte as it was."""
    from tests.helpers import tree_digest

    warehouse, config_id = _run_warehouse_copy(small_run, tmp_path)
    mine, notes = tmp_path / "mine", tmp_path / "notes.txt"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    notes.write_text("my notes")
    policy = small_run / "checkpoints" / "iteration-1"
    for out, why in ((warehouse.root, "cleaner did not write it (no .cleaner-output.json; it holds "),
                     (mine, "cleaner did not write it (no .cleaner-output.json; it holds notes.txt)"),
                     (notes, "it exists and is a file, not a directory")):
        before, steps_before = tree_digest(out), tree_digest(warehouse.root / "train_steps")
        _fails_cleanly(["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id", config_id,
                        "--policy", str(policy), "--out", str(out), "--mini-batch-size", "8"],
                       f"{out}: will not replace it with a checkpoint: {why}")
        assert tree_digest(out) == before
        assert tree_digest(warehouse.root / "train_steps") == steps_before  # nothing trained
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt", "warehouse"]  # no temp left


def test_train_out_replaces_the_checkpoint_it_wrote(small_run, tmp_path):
    warehouse, config_id = _run_warehouse_copy(small_run, tmp_path)
    steps_before = len(warehouse.read_train_steps(0))  # the run's
    command = ["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id", config_id, "--policy",
               str(small_run / "checkpoints" / "iteration-1"), "--out", str(tmp_path / "out"),
               "--mini-batch-size", "8"]
    steps = []  # per training: the rows of its checkpoint
    for _ in range(2):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        steps.append(warehouse.connect().sql(
            "SELECT config_id, optimizer_step, created_at FROM train_steps WHERE checkpoint = ? ORDER BY 2",
            params=[str((tmp_path / "out").resolve())]).fetchall())
    assert (tmp_path / "out" / ".cleaner-output.json").is_file()
    # 16 rows in mini batches of 8: two steps, named by their config and checkpoint; the second
    # training replaced the first's rows instead of adding two more
    assert [[(config, step) for config, step, _ in rows] for rows in steps] == [[(config_id, 2), (config_id, 3)]] * 2
    assert len(warehouse.read_train_steps(0)) == steps_before + 2


def test_demo_never_deletes_a_directory_it_did_not_write(tmp_path):
    from tests.helpers import tree_digest

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    before = tree_digest(mine)
    _fails_cleanly(["demo", "--run-dir", str(mine), "--iterations", "1", "--prompts", "1"],
                   f"{mine}: not a run directory cleaner wrote (holds notes.txt)")
    assert tree_digest(mine) == before


@pytest.mark.parametrize(("toml", "expected"), [
    ('[collect]\ngroup_size = "four"\n', "bad.toml.collect.group_size: expected int, got 'four'"),
    ('[train]\nmini_batch_size = "2"\n', "bad.toml.train.mini_batch_size: expected int, got '2'"),
    ("collect = 5\n", "bad.toml.collect: expected a table, got 5"),
    ("[collect.sandbox]\nworkers = 1.5\n", "bad.toml.collect.sandbox.workers: expected int, got 1.5"),
])
def test_run_config_of_the_wrong_type_is_one_line(tmp_path, toml, expected):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    _fails_cleanly(["run", "--run-dir", str(tmp_path / "r"), "--config", str(path)], expected)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("command", "expected", "not_expected"), [
    (["collect", "--prompts", "0"], "invalid option: --prompts must be >= 1, got 0", "n_prompts"),
    (["collect", "--sandbox-workers", "0"], "invalid option: --sandbox-workers must be >= 1, got 0", "option: workers"),
    (["run", "--mini-batch-size", "0"], "invalid option: --mini-batch-size must be >= 1, got 0", "micro_batch_size"),
    (["run", "--prompts", "0"], "invalid option: --prompts must be >= 1, got 0", "n_prompts"),
    (["train", "--config-id", "c", "--policy", ".", "--out", "o", "--mini-batch-size", "4"],
     "invalid option: --mini-batch-size (4) must be >= --micro-batch-size (8)", "micro_batch_size"),
    # SAAR's checks, the same wherever its group is held (config/groups.py)
    (["show", "r0", "--gamma", "-1"], "invalid option: --gamma must be >= 0, got -1.0", "no rollout"),
    (["show", "r0", "--similarity-on", "codes"],
     "invalid option: --similarity-on must be one of ['code', 'call'], got 'codes'", "similarity_on"),
    (["eval", "--model", "m", "--dataset", "a=a.parquet", "--gamma", "-1"], "invalid option: --gamma must be >= 0, "
     "got -1.0", "a.parquet"),
])
def test_errors_name_the_flag_the_user_typed(tmp_path, command, expected, not_expected):
    where = ["--run-dir", str(tmp_path / "r")] if command[0] == "run" else ["-w", str(tmp_path / "w")]
    output = _fails_cleanly([*command, *where], expected)
    assert not_expected not in output


def test_a_file_given_as_the_warehouse_is_one_line(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    model = ["--model", str(DEFAULT_POLICY)]
    for command in (["collect", "-w", str(taken), *SMALL], ["purify", "-w", str(taken)],
                    ["eval", "-w", str(taken), *model, "--dataset", f"toy={tmp_path / 'none.parquet'}"]):
        _fails_cleanly(command, f"{taken}: is a file, not a warehouse directory")
    _fails_cleanly(["collect", "-w", str(taken / "sub"), *SMALL], f"{taken / 'sub'}: {taken} is a file")
    _fails_cleanly(["run", "--run-dir", str(taken), *SMALL], f"{taken / 'warehouse'}: {taken} is a file")
    assert taken.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_sql_output_that_cannot_be_written_is_one_line(tmp_path):
    warehouse = Warehouse(tmp_path / "wh")
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    for output_format in ("table", "csv"):
        _fails_cleanly(["sql", "SELECT 1", "-w", str(warehouse.root), "-f", output_format,
                        "--output", str(tmp_path / "missing" / "out.csv")],
                       f"--output {tmp_path / 'missing' / 'out.csv'}: cannot write the result (No such file")


def test_train_takes_the_config_id_as_purify_prints_it(small_run, tmp_path):
    warehouse, config_id = _run_warehouse_copy(small_run, tmp_path)
    steps_before = len(warehouse.read_train_steps(0))  # the run's
    result = runner.invoke(app, ["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id",
                                 config_id[:8], "--policy", str(small_run / "checkpoints" / "iteration-1"),
                                 "--out", str(tmp_path / "out"), "--mini-batch-size", "8"])
    assert result.exit_code == 0, result.output
    assert len(warehouse.read_train_steps(0)) == 2 * steps_before  # trained again on the same 16 rows


def test_a_token_budget_makes_the_micro_batch_row_count_irrelevant(small_run, tmp_path):
    """With --max-tokens-per-micro-batch the rows of a micro batch are packed by tokens, so a mini
    batch smaller than --micro-batch-size (8 by default) is no contradiction."""
    warehouse, config_id = _run_warehouse_copy(small_run, tmp_path)
    result = runner.invoke(app, ["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id", config_id,
                                 "--policy", str(small_run / "checkpoints" / "iteration-1"), "--out",
                                 str(tmp_path / "out"), "--mini-batch-size", "2", "--max-tokens-per-micro-batch",
                                 "16384"])
    assert result.exit_code == 0, result.output
    steps = [s for s in warehouse.read_train_steps(0) if s.checkpoint == str(tmp_path / "out")]
    assert len(steps) == 16 // 2  # 16 rows, 2 per optimiser step


def _broken_policy(tmp_path, broken: str):
    """A copy of the tiny policy without its weights or tokenizer, or with a damaged weight file."""
    import shutil

    model = shutil.copytree(DEFAULT_POLICY, tmp_path / f"policy-{broken}")
    if broken == "no-weights":
        (model / "model.safetensors").unlink()
    elif broken == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).unlink()
    else:
        (model / "model.safetensors").write_bytes(b"not safetensors")
    return model


@pytest.mark.parametrize(("broken", "expected"), [
    ("no-weights", "the directory has no weight files (*.safetensors, *.bin, *.pt)"),
    ("no-tokenizer", "the directory has no tokenizer files"),
    ("damaged-weights", "cannot load a causal LM"),
])
def test_a_model_that_cannot_load_leaves_nothing_behind(tmp_path, broken, expected):
    model = _broken_policy(tmp_path, broken)
    _fails_cleanly(["collect", "-w", str(tmp_path / "w"), "--model", str(model), *SMALL], expected)
    _fails_cleanly(["run", "--run-dir", str(tmp_path / "runs" / "r"), "--model", str(model), *SMALL], expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]  # no warehouse, configs, run dir or lock


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--gamma", "", "--gamma takes one or more comma-separated numbers, got ''"),
    ("--rollback-prob", " , ", "--rollback-prob takes one or more comma-separated numbers, got ' , '"),
    ("--similarity-on", "", "--similarity-on takes one or more comma-separated values, got ''"),
])
def test_ablate_with_an_empty_grid_axis_is_an_error(tmp_path, option, value, expected):
    _fails_cleanly(["ablate", "-w", str(tmp_path / "w"), option, value], expected)


@pytest.mark.parametrize(("command", "value", "expected"), [
    (["curate", "--stats-out", "s.jsonl"], " , ", "--iteration takes one or more iteration numbers, got ' , '"),
    (["curate", "--stats-out", "s.jsonl"], "1,x", "--iteration takes comma-separated iteration numbers, got '1,x'"),
    (["export", "--format", "sft", "--out", "d"], "", "--iteration takes one or more iteration numbers, got ''"),
    (["export", "--format", "sft", "--out", "d"], "0.5", "--iteration takes comma-separated iteration numbers, got '0.5'"),
])
def test_an_iteration_list_without_a_number_is_one_line(tmp_path, command, value, expected):
    _fails_cleanly([*command, "-w", str(tmp_path / "w"), "--iteration", value], expected)
    assert list(tmp_path.iterdir()) == []


def test_exports_iteration_list_reads_a_repeated_number_once(monkeypatch, tmp_path):
    import cleaner.engine.export.job as export

    requests = []

    def export_job(warehouse, request):
        requests.append(request)
        raise JobError("stopped before any work")

    monkeypatch.setattr(export, "export_job", export_job)
    runner.invoke(app, ["export", "-w", str(tmp_path / "w"), "--iteration", "2,0,2", "--format", "sft", "--out",
                        str(tmp_path / "d")])
    assert [request.iterations for request in requests] == [(2, 0)]


@pytest.mark.parametrize("query", ["", "   ", "/* a comment only */", ";"])
def test_sql_without_a_statement_is_an_error(tmp_path, query):
    warehouse = Warehouse(tmp_path / "wh")
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    _fails_cleanly(["sql", query, "-w", str(warehouse.root)], "holds no SQL statement")


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    """TOML is UTF-8; a file saved as Latin-1 (an accent in a comment) is named, not a traceback."""
    path = tmp_path / "latin1.toml"
    path.write_bytes("[train]\nlr = 1e-4  # café\n".encode("latin-1"))
    _fails_cleanly(["run", "--run-dir", str(tmp_path / "r"), "--config", str(path)],
                   f"{path}: not valid TOML: byte 24 is not UTF-8 (counting from 0")
    assert not (tmp_path / "r").exists()


def _lora_commands(tmp_path) -> list[list[str]]:
    """train and run with the tiny policy, each writing under tmp_path (nothing, if refused)."""
    return [["train", "-w", str(tmp_path / "w"), "--iteration", "0", "--config-id", "abc", "--policy",
             str(DEFAULT_POLICY), "--out", str(tmp_path / "out")],
            ["run", "--run-dir", str(tmp_path / "run"), "--iterations", "1", *SMALL]]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--lora-rank", "-1"], "invalid option: --lora-rank must be >= 0 (0 = off), got -1"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "invalid option: --lora-alpha must be > 0 with --lora-rank 8, got 0"),
    # (a flag not given keeps its field's name: train says --lora-rank, run lora_rank)
    (["--lora-alpha", "32"], ("--lora-alpha shape LoRA adapters, which", "rank 0 turns off: set",
                              "rank > 0 too, or drop them")),
    (["--lora-target-modules", "q_proj"], "--lora-target-modules shape LoRA adapters, which"),
    (["--lora-rank", "8", "--lora-target-modules", "q_proj,qkv"],
     "--lora-target-modules q_proj,qkv: model type 'qwen3' has no module qkv; its linear layers are down_proj, "
     "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear: every one)"),
    (["--lora-rank", "8", "--lora-target-modules", "lm_head"], "has lm_head as its lm_head, whose weight the "
                                                               "chunked head reads itself"),
], ids=["negative-rank", "alpha-0", "alpha-without-rank", "targets-without-rank", "missing-target", "the-head"])
def test_lora_settings_that_cannot_train_are_refused_before_any_work(tmp_path, flags, expected):
    for command in _lora_commands(tmp_path):
        _fails_cleanly([*command, *flags], *([expected] if isinstance(expected, str) else expected))
    assert not (tmp_path / "w").exists() and not (tmp_path / "out").exists()
    assert not (tmp_path / "run" / "warehouse").exists()


def test_a_lora_checkpoint_trained_without_its_adapters_is_refused_before_any_work(tmp_path):
    """`train --policy CKPT` on a LoRA checkpoint: without --lora-rank (it would train the merged
    weights, the adapters' optimiser state beside them) or with other adapters, one line saying how
    to continue it; nothing written."""
    from cleaner.config import TrainConfig
    from cleaner.engine.model.loading import load_policy
    from cleaner.engine.train.trainer import train_iteration
    from tests.factories import train_batch

    config = TrainConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=4, lora_rank=4)
    checkpoint = train_iteration(train_batch(load_policy(DEFAULT_POLICY)), DEFAULT_POLICY, tmp_path / "lora", config,
                                 0, progress=False).out_path
    command = ["train", "-w", str(tmp_path / "w"), "--iteration", "0", "--config-id", "abc", "--policy",
               str(checkpoint), "--out", str(tmp_path / "out")]
    _fails_cleanly(command, f"{checkpoint}: a LoRA checkpoint (rank 4 adapters on {DEFAULT_POLICY}): continue it "
                            "with --lora-rank 4 --lora-alpha 16 --lora-target-modules all-linear")
    _fails_cleanly([*command, "--lora-rank", "8"], "its adapters (rank 4, alpha 16, on 14 layers) are not the ones "
                                                   "these settings train (rank 8")
    assert not (tmp_path / "w").exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# The objectives: verl's names, refused as one line before any work

@pytest.mark.parametrize(("command", "expected"), [
    (["train", "--loss-mode", "ppo"], "invalid option: --loss-mode must be one of ['vanilla', 'gspo', 'cispo', 'geo_mean'], got 'ppo'"),
    (["train", "--loss-agg-mode", "sum"], "invalid option: --loss-agg-mode must be one of ('token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'), got 'sum'"),
    (["train", "--loss-mode", "gspo", "--loss-agg-mode", "token-mean"],
     "--loss-mode gspo aggregates its policy loss seq-mean-token-mean, as verl forces it whatever --loss-agg-mode says"),
    (["train", "--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-scale-factor", "0"],
     "invalid option: --loss-scale-factor must be > 0, got 0"),
    (["train", "--loss-scale-factor", "-4"], "invalid option: --loss-scale-factor must be > 0, got -4"),
    (["train", "--loss-scale-factor", "512"], "--loss-scale-factor is the constant of --loss-agg-mode seq-mean-token-sum-norm"),
    (["purify", "--adv-estimator", "ppo"],
     "invalid option: --adv-estimator must be one of ['grpo', 'rloo', 'reinforce_plus_plus_baseline'], got 'ppo'"),
    (["purify", "--adv-estimator", "rloo", "--no-norm-adv-by-std"],
     "--norm-adv-by-std off is GRPO's (verl's norm_adv_by_std_in_grpo), and rloo divides by no std"),
    (["purify", "--adv-estimator", "reinforce_plus_plus_baseline", "--shard", "1/2"],
     "--shard 1/2: adv_estimator reinforce_plus_plus_baseline whitens the advantages over the whole iteration, "
     "which a shard does not see"),
    (["ablate", "--adv-estimator", "grpo,ppo"], "--adv-estimator must be one of"),
    (["ablate", "--norm-adv-by-std", "yes"], "--norm-adv-by-std takes comma-separated true and false, got 'yes'"),
    (["run", "--loss-mode", "gspo", "--loss-agg-mode", "seq-mean-token-sum"], "as verl forces it"),
    (["run", "--adv-estimator", "reinforce"], "--adv-estimator must be one of"),
])
def test_an_unknown_objective_or_a_combination_verl_refuses_is_one_line(tmp_path, command, expected):
    where = ["--run-dir", str(tmp_path / "r")] if command[0] == "run" else ["-w", str(tmp_path / "w")]
    train = ["--config-id", "c" * 12, "--policy", str(DEFAULT_POLICY), "--out", str(tmp_path / "o")]
    _fails_cleanly([*command, *where, *(train if command[0] == "train" else [])], expected)
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists() and not (tmp_path / "o").exists()
