"""One declaration per option: every config field is a flag, with the field's default, on every
command that uses the config (docs/architecture.md §9), and the phase commands take every setting a
`cleaner run` resolves."""

from __future__ import annotations

import dataclasses
import tomllib
import typing

import pytest
import typer
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY
from cleaner.config.flags import ABLATE_GRID, COMMANDS, RUN_FLAGS, field_help
from cleaner.config.layers import DERIVED, RUN_BASE_LAYER
from cleaner.config.settings import setting
from cleaner.errors import JobError

runner = CliRunner()
SECTIONS = ("collect", "purify", "train")
# The fields a command sets otherwise: a run numbers its iterations; eval repeats --model and
# --dataset and runs each SAAR setting given (--saar, --no-saar).
OTHERWISE = {"run": {("collect", "iteration"): ()},
             "eval": {("models",): ("--model",), ("datasets",): ("--dataset",), ("saar",): ("--saar", "--no-saar")},
             "curate": {("iterations",): ("--iteration",), ("evals",): ("--eval",)}}


def _leaves(cls: type, path: tuple[str, ...] = ()):
    """(path, default) of every leaf field of a (nested) config dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], (*path, f.name))
        else:
            yield (*path, f.name), f.default_factory() if f.default is dataclasses.MISSING else f.default


def _option(path: tuple[str, ...]) -> str:
    """The flag of a field, as docs/architecture.md §9 names it: `--field-name`, a nested config's
    name before it (`--sandbox-workers`), run's tables unprefixed, n_prompts spelled `--prompts`."""
    words = [word for word in path[:-1] if word not in SECTIONS] + [{"n_prompts": "prompts"}.get(path[-1], path[-1])]
    return "--" + "-".join(words).replace("_", "-")


def _expected_default(command: str, path: tuple[str, ...], default: object) -> object:
    if command == "ablate" and path[-1] in ABLATE_GRID:
        return ABLATE_GRID[path[-1]]  # a grid axis: a list of the field's values
    if (command, path) == ("eval", ("max_new_tokens",)) or (command == "run" and path in DERIVED):
        return None  # follows another flag
    if command == "run":
        table = RUN_BASE_LAYER.get(path[0], {}) if len(path) > 1 else {}
        default = table.get(path[-1], default) if len(path) == 2 else default
    return default.value if hasattr(default, "value") else default


@pytest.mark.parametrize("command", ["collect", "purify", "ablate", "train", "eval", "run", "curate", "bootstrap"])
def test_every_config_field_is_a_flag_with_the_fields_default(command):
    params = {opt: param for param in typer.main.get_command(app).commands[command].params for opt in param.opts}
    checked = 0
    for path, default in _leaves(COMMANDS[command].config):
        if path in OTHERWISE.get(command, {}):
            assert all(option in params for option in OTHERWISE[command][path]), (command, path)
            continue
        option = _option(path)
        assert option in params, f"cleaner {command} has no flag for {'.'.join(path)} (expected {option})"
        assert params[option].default == _expected_default(command, path, default), (command, option)
        checked += 1
    assert checked >= (8 if command == "curate" else 10)  # curate: its ten fields but the two lists


def test_run_flags_set_every_field_of_the_run_but_the_iteration():
    from cleaner.config import RunConfig

    paths = {path for paths in RUN_FLAGS.values() for path in paths}
    assert paths == {path for path, _ in _leaves(RunConfig)} - {("collect", "iteration")}
    # one flag keeps the run purifying at its collect config; train follows collect's budget, seed, device
    assert RUN_FLAGS["gamma"] == (("collect", "gamma"), ("purify", "gamma"))
    assert RUN_FLAGS["seed"] == (("collect", "seed"), ("train", "seed"))
    assert RUN_FLAGS["sandbox_memory_mb"] == (("collect", "sandbox", "memory_mb"),)


def test_a_config_field_without_its_help_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Documented:
        steps: int = setting(3, help="optimiser steps")
        rate: float = 0.5  # a comment is not its help

    with pytest.raises(TypeError, match="Documented.rate has no help"):
        field_help(Documented)


def test_a_help_longer_than_a_line_is_the_flags_help_whole():
    """The help is the field's `setting(help=...)`, however long: collect's --multi-turn, as --help prints it."""
    from cleaner.config import CollectConfig

    declared = next(item for item in dataclasses.fields(CollectConfig) if item.name == "multi_turn").metadata["help"]
    assert declared == ("tool calls run, turn after turn; off: verl's multi_turn.enable=False, the reference's no-tool "
                        "baseline (no tool in the template, its no-tool prompts, one generation)")
    params = {param.name: param for param in typer.main.get_command(app).commands["collect"].params}
    assert params["multi_turn"].help == declared


# ---------------------------------------------------------------------------------------------
# The phase commands reproduce a run's configs


def _args(table: dict, prefix: str = "") -> list[str]:
    """The flags that give every value of a resolved config table."""
    args = []
    for key, value in table.items():
        if isinstance(value, dict):
            args += _args(value, f"{prefix}{key}-")
            continue
        option = "--" + prefix + {"n_prompts": "prompts"}.get(key, key).replace("_", "-")
        if isinstance(value, bool):
            args.append(option if value else "--no-" + option[2:])
        elif value is not None:
            args += [option, str(value)]
    return args


def _requests(monkeypatch, module: str, name: str) -> list:
    """The requests the command hands the job (which then fails without doing anything)."""
    import importlib

    seen = []

    def job(warehouse, request, **handles):
        seen.append(request)
        raise JobError("stopped before any work")

    monkeypatch.setattr(importlib.import_module(module), name, job)
    return seen


def test_collect_purify_and_train_take_every_setting_of_a_run(monkeypatch, tmp_path):
    run = runner.invoke(app, ["run", "--prompts", "16", "--top-p", "0.9", "--test-timeout-s", "2",
                              "--sandbox-memory-mb", "512", "--sandbox-workers", "1", "--gamma", "0.7",
                              "--edit", "mask", "--advantage-eps", "1e-5", "--clip-eps-low", "0.1",
                              "--max-grad-norm", "0.5", "--rollout-is-threshold", "3", "--seed", "3", "--print-config"])
    assert run.exit_code == 0, run.output
    resolved = tomllib.loads(run.output)
    where = ["-w", str(tmp_path / "w")]

    collected = _requests(monkeypatch, "cleaner.engine.collect.job", "collect_job")
    result = runner.invoke(app, ["collect", *where, *_args(resolved["collect"])])
    assert "stopped before any work" in result.output
    assert collected[0].config.to_dict() == resolved["collect"] | {"data": None, "sglang_url": None, "reward_fn": None,
                                                                   "tools": None, "tool": None,
                                                                   "sglang_mem_fraction": None, "rollout_dtype": None,
                                                                   "max_tool_response_chars": None,
                                                                   "sglang_request_timeout_s": None}

    purified = _requests(monkeypatch, "cleaner.engine.purify.job", "purify_job")
    runner.invoke(app, ["purify", *where, *_args(resolved["purify"])])
    assert [config.to_dict() for config in purified[0].configs] == [resolved["purify"] | {
        "down_sample_to": None, "sglang_url": None, "scorer_memory_gb": None}]

    trained = _requests(monkeypatch, "cleaner.engine.train.job", "train_job")
    runner.invoke(app, ["train", *where, "--config-id", "abc", "--policy", str(DEFAULT_POLICY), "--out",
                        str(tmp_path / "out"), *_args(resolved["train"])])
    assert trained[0].config.to_dict() == resolved["train"] | {
        "deepspeed_config": None, "max_tokens_per_micro_batch": None, "rollout_is": None, "rollout_rs": None,
        "rollout_rs_threshold": None, "rollout_rs_threshold_lower": None, "rollout_token_veto_threshold": None,
        "loss_agg_mode": None, "loss_scale_factor": None}
    assert (trained[0].config.clip_eps_low, trained[0].config.max_grad_norm, trained[0].config.seed) == (0.1, 0.5, 3)


def test_a_nested_field_error_names_its_flag(tmp_path):
    result = runner.invoke(app, ["collect", "-w", str(tmp_path / "w"), "--sandbox-memory-mb", "10"])
    assert result.exit_code == 1
    assert "error: invalid option: --sandbox-memory-mb must be >= 64, got 10" in " ".join(result.output.split())


# ---------------------------------------------------------------------------- numbers that cannot work


def _number_fields(cls: type) -> list[str]:
    """The fields of a config that hold a number (int or float, or optionally one)."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if any(kind in (int, float) for kind in (typing.get_args(hints[f.name]) or (hints[f.name],)))
            and hints[f.name] is not bool]


def _configs():
    from cleaner.config import CollectConfig, EvalConfig, PurifyConfig, RunConfig, TrainConfig
    from cleaner.sandbox import SandboxConfig

    eval_base = {"datasets": (("d", "/tmp/d.parquet"),)}
    return [(CollectConfig, {}), (PurifyConfig, {}), (TrainConfig, {}), (RunConfig, {}), (SandboxConfig, {}),
            (EvalConfig, eval_base)]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_number_of_every_config_is_finite(value):
    checked = 0
    for cls, base in _configs():
        for name in _number_fields(cls):
            with pytest.raises(ValueError, match=f"^{name} must be a finite number, got {value}$"):
                cls(**base, **{name: value})
            checked += 1
    assert checked >= 60  # every number of the six configs, not a sample


def test_every_duration_is_within_a_day():
    servers = {"backend": "sglang", "sglang_url": "http://127.0.0.1:1"}  # what a server's timeout needs
    for cls, base in _configs():
        for name in [name for name in _number_fields(cls) if name.endswith("_s")]:
            needs = base | (servers if name == "sglang_request_timeout_s" else {})
            for value in (1e10, 86_401, 0, -1):
                with pytest.raises(ValueError, match=f"^{name} must be in \\(0, 86,400\\] seconds"):
                    cls(**needs, **{name: value})
            cls(**needs, **{name: 86_400})


@pytest.mark.parametrize("args", [
    ["train", "--lr", "inf"], ["train", "--lr", "nan"], ["train", "--max-grad-norm", "inf"],
    ["collect", "--reward-timeout-s", "inf"], ["collect", "--reward-timeout-s", "1e10"],
    ["collect", "--sandbox-timeout-s", "inf"], ["collect", "--temperature", "nan"],
    ["train", "--rollout-rs-threshold-lower", "0.5"], ["train", "--rollout-rs-threshold", "2"],
    ["train", "--rollout-is-batch-normalize"], ["collect", "--sglang-request-timeout-s", "5"],
    ["collect", "--sglang-mem-fraction", "0.5"],
])
def test_settings_that_cannot_work_are_one_line_before_any_work(tmp_path, args):
    command, *flags = args
    where = ["-w", str(tmp_path / "w")]
    extra = (["--config-id", "abc", "--policy", str(DEFAULT_POLICY), "--out", str(tmp_path / "out")]
             if command == "train" else [])
    result = runner.invoke(app, [command, *where, *extra, *flags])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: invalid option: ") and flags[0] in line, line
    assert not (tmp_path / "w").exists() and not (tmp_path / "out").exists()


def test_a_toml_layer_is_held_to_the_same_numbers(tmp_path):
    (tmp_path / "run.toml").write_text("[train]\nlr = inf\n")
    result = runner.invoke(app, ["run", "--run-dir", str(tmp_path / "run"), "--config", str(tmp_path / "run.toml")])
    assert result.exit_code == 1 and result.output.strip() == (
        f"error: {tmp_path / 'run.toml'}.train: lr must be a finite number, got inf")
    assert not (tmp_path / "run").exists()


def test_ablate_crosses_the_estimators_and_gives_the_std_switch_to_grpo_alone(monkeypatch, tmp_path):
    """`--adv-estimator grpo,rloo,reinforce_plus_plus_baseline --norm-adv-by-std true,false`: grpo
    with and without the std (Dr.GRPO), the others once each (they divide by no std)."""
    purified = _requests(monkeypatch, "cleaner.engine.purify.job", "purify_job")
    runner.invoke(app, ["ablate", "-w", str(tmp_path / "w"), "--gamma", "0.5", "--rollback-prob", "1.0",
                        "--adv-estimator", "grpo,rloo,reinforce_plus_plus_baseline", "--norm-adv-by-std", "true,false"])
    configs = purified[0].configs
    assert [(c.adv_estimator.value, c.norm_adv_by_std) for c in configs] == [
        ("grpo", True), ("grpo", False), ("rloo", True), ("reinforce_plus_plus_baseline", True)]
    assert len({c.config_id for c in configs}) == 4
