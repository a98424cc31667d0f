"""Options that say how a command runs (where purify scores, bootstrap's training) are settings like
any other (docs/architecture.md §9): declared once in a config, their flags generated; a run scores
where it collects, and its TOML and flags set purify's scorer budget."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from types import SimpleNamespace

import pytest
import typer.main
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import CollectConfig, PurifyConfig, RunConfig
from cleaner.config.flags import COMMANDS, command_flags
from cleaner.errors import JobError

runner = CliRunner()
CONTEXT = "flags_context"  # cli/options.py's: the typer context of a generated signature
# The options of these commands that are not their config's flags: what they read and write.
INPUTS_AND_OUTPUTS = {"purify": {"warehouse", "iteration", "shard"}, "ablate": {"warehouse", "iteration", "shard"},
                      "bootstrap": {"out"}}


def _commands(group, prefix: str = ""):
    """(name, click command) of every command of the app, a group's with its name before."""
    for name, command in sorted(group.commands.items()):
        if hasattr(command, "commands"):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name, command


def _how_to_run() -> set[str]:
    """The fields a settings group marks as saying how to run (identity never), and where it runs."""
    names = {"backend", "device"}  # collect's count toward its id (numerics differ), purify's do not
    pending = [spec.config for spec in COMMANDS.values()]
    while pending:
        cls = pending.pop()
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[item.name]):
                pending.append(hints[item.name])
            elif item.metadata.get("identity") == "never":
                names.add(item.name)
    return names


def test_no_command_types_an_option_a_settings_group_declares_as_how_to_run():
    how_to_run, checked = _how_to_run(), 0
    assert {"sglang_url", "scorer_memory_gb", "threads", "checkpoint_every", "batch_rollouts"} <= how_to_run
    for name, command in _commands(typer.main.get_command(app)):
        generated = {flag.name for flag in command_flags(name)} if name in COMMANDS else set()
        by_hand = {param.name for param in command.params} - generated - {CONTEXT}
        assert by_hand & how_to_run == set(), f"cleaner {name} types {sorted(by_hand & how_to_run)} by hand"
        if name in INPUTS_AND_OUTPUTS:
            assert by_hand == INPUTS_AND_OUTPUTS[name], name
            checked += 1
    assert checked == len(INPUTS_AND_OUTPUTS)


def _requests(monkeypatch, module, name: str) -> list:
    """The requests a command hands its job, which then stops before any work."""
    seen = []

    def job(*args, **handles):
        seen.append(args[-1])
        raise JobError("stopped before any work")

    monkeypatch.setattr(module, name, job)
    return seen


@pytest.mark.parametrize("command", ["purify", "ablate"])
def test_purify_scores_where_its_flags_say(monkeypatch, tmp_path, command):
    import cleaner.engine.purify.job as purify

    requests = _requests(monkeypatch, purify, "purify_job")
    result = runner.invoke(app, [command, "-w", str(tmp_path / "w"), "--backend", "sglang", "--sglang-url",
                                 "http://127.0.0.1:9", "--device", "cuda:1", "--scorer-memory-gb", "2.5"])
    assert "stopped before any work" in result.output, result.output
    (request,) = requests
    assert (request.backend_kind, request.sglang_url, request.device, request.scorer_memory_gb) == (
        "sglang", "http://127.0.0.1:9", "cuda:1", 2.5)
    assert {(c.backend, c.device, c.scorer_memory_gb) for c in request.configs} == {("sglang", "cuda:1", 2.5)}


# ---------------------------------------------------------------------------------------------
# A run scores with the backend it collects with


def _print_config(tmp_path, toml: str, *flags: str):
    (tmp_path / "run.toml").write_text(toml)
    return runner.invoke(app, ["run", "--config", str(tmp_path / "run.toml"), *flags, "--print-config"])


def test_a_run_purifies_where_it_collects_and_takes_the_scorer_budget_from_its_file_or_flag(tmp_path):
    result = _print_config(tmp_path, '[collect]\ndevice = "cuda:1"\n\n[purify]\nscorer_memory_gb = 4\n')
    assert result.exit_code == 0, result.output
    resolved = tomllib.loads(result.output)
    assert (resolved["purify"]["device"], resolved["purify"]["backend"]) == ("cuda:1", "torch")
    assert resolved["purify"]["scorer_memory_gb"] == 4.0
    result = _print_config(tmp_path, "", "--backend", "sglang", "--device", "cuda", "--scorer-memory-gb", "1.5")
    resolved = tomllib.loads(result.output)
    assert {name: resolved["purify"][name] for name in ("backend", "device", "scorer_memory_gb")} == {
        "backend": "sglang", "device": "cuda", "scorer_memory_gb": 1.5}
    assert resolved["collect"]["backend"] == "sglang" and resolved["train"]["device"] == "cuda"


def test_a_run_whose_purify_would_score_elsewhere_is_one_line(tmp_path):
    result = _print_config(tmp_path, '[purify]\ndevice = "cuda"\n')
    assert result.exit_code == 1
    assert result.output.strip() == (f"error: {tmp_path / 'run.toml'}: purify's device must be collect's: a run "
                                     "scores with the backend it collects with, got 'cuda' and 'cpu'")


def test_a_runs_purify_hands_the_scorer_budget_and_the_runs_backend_to_the_job(monkeypatch, tmp_path):
    from cleaner.loop import iterations
    from cleaner.loop.ranks import Ranks

    requests = []
    monkeypatch.setattr(iterations, "collect_job", lambda *args, **kwargs: SimpleNamespace(n_planned=1))
    monkeypatch.setattr(iterations, "purify_job", lambda warehouse, request, **kwargs: requests.append(request))
    config = RunConfig(collect=CollectConfig(device="cuda:1"),
                       purify=PurifyConfig(scorer_memory_gb=3.0))  # its device: collect's
    backend = object()
    iterations._collect_and_purify(None, config.collect, config, backend, False, Ranks())
    (request,) = requests
    assert (request.backend_kind, request.device, request.scorer_memory_gb) == ("torch", "cuda:1", 3.0)


# ---------------------------------------------------------------------------------------------
# bootstrap


def test_bootstrap_builds_its_corpus_and_training_from_its_flags(monkeypatch, tmp_path):
    from cleaner.toys import sft
    from cleaner.toys.corpus import CorpusConfig

    seen = []
    monkeypatch.setattr(sft, "bootstrap_policy", lambda config, out: seen.append((config, out)) or SimpleNamespace(
        out_dir=out, final_loss=0.0, tokens_seen=0, wall_s=0.0))
    result = runner.invoke(app, ["bootstrap", "--out", str(tmp_path / "p"), "--steps", "7", "--seed", "3",
                                 "--corpus-size", "90", "--fail-share", "0.4", "--failures", "environment",
                                 "--slip-share", "0.1", "--no-tool-share", "0.2", "--batch-size", "5",
                                 "--checkpoint-every", "2", "--lr", "0.001", "--init-from", str(tmp_path),
                                 "--threads", "1"])
    assert result.exit_code == 0, result.output
    corpus = CorpusConfig(size=90, seed=3, fail_share=0.4, failures="environment", slip_share=0.1, no_tool_share=0.2)
    assert seen == [(sft.BootstrapConfig(corpus=corpus, steps=7, batch_size=5, seed=3, lr=0.001, checkpoint_every=2,
                                         threads=1, init_from=str(tmp_path)), tmp_path / "p")]


@pytest.mark.parametrize(("flags", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"), (["--corpus-size", "0"], "--corpus-size must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"), (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (0 = off), got -1"),
    (["--failures", "some"], "--failures must be one of ('mixed', 'environment'), got 'some'"),
    (["--slip-share", "1.5"], "--slip-share must be in [0, 1], got 1.5"), (["--lr", "0"], "--lr must be > 0, got 0.0"),
])
def test_a_bootstrap_option_that_cannot_work_is_one_line_before_any_work(monkeypatch, tmp_path, flags, message):
    from cleaner.toys import sft

    trained = []
    monkeypatch.setattr(sft, "bootstrap_policy", lambda *args: trained.append(args))
    result = runner.invoke(app, ["bootstrap", "--out", str(tmp_path / "p"), *flags])
    assert result.exit_code == 1 and result.output.strip() == f"error: invalid option: {message}"
    assert trained == [] and list(tmp_path.iterdir()) == []


def test_bootstraps_init_from_must_be_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    for missing in (tmp_path / "nowhere", tmp_path / "file"):
        result = runner.invoke(app, ["bootstrap", "--out", str(tmp_path / "p"), "--init-from", str(missing)])
        assert result.exit_code == 2 and "--init-from" in result.output


def test_runs_help_keeps_where_it_runs_under_collect_and_the_scorer_budget_under_purify():
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "120"})
    section, found = None, {}
    for line in result.output.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
        elif line.strip().startswith("--"):
            found.setdefault(line.split()[0], section)
    assert {option: found[option] for option in ("--backend", "--sglang-url", "--device", "--scorer-memory-gb")} == {
        "--backend": "Collect", "--sglang-url": "Collect", "--device": "Options", "--scorer-memory-gb": "Purify"}


def test_a_resumed_run_scores_at_the_server_address_its_file_gives_now(tmp_path):
    """A server may come back at another address: a resumed run's file moves collect's sglang_url,
    and purify's, which the saved run holds as collect's old one, moves with it."""
    from cleaner.warehouse import Warehouse

    servers = {"backend": "sglang", "sglang_url": "http://127.0.0.1:9"}
    saved = RunConfig(run_dir=str(tmp_path / "run"), collect=CollectConfig(**servers))
    assert saved.purify.sglang_url == "http://127.0.0.1:9"
    Warehouse(tmp_path / "run" / "warehouse").save_config("run", saved.to_json())
    result = _print_config(tmp_path, '[collect]\nbackend = "sglang"\nsglang_url = "http://127.0.0.1:10"\n', "--run-dir",
                           str(tmp_path / "run"), "--resume")
    assert result.exit_code == 0, result.output
    resolved = tomllib.loads(result.output)
    assert resolved["collect"]["sglang_url"] == resolved["purify"]["sglang_url"] == "http://127.0.0.1:10"


def test_the_demos_own_flags_reach_the_run_it_resolves(monkeypatch, tmp_path):
    """`cleaner demo --model M --lora-rank 8 --lr 1e-3`: the run the demo starts collects from M
    and trains rank-8 adapters at 1e-3 (docs/running.md's LoRA table was run so); unset, the
    tiny default policy, no adapters and run's learning rate."""
    from cleaner.cli import loop
    from cleaner.config import DEFAULT_POLICY, RECOVER_POLICY

    started = []

    def stop(config, resume, fresh):
        started.append(config)
        raise typer.Exit(0)

    monkeypatch.setattr(loop, "_run_and_report", stop)
    for args in ([], ["--model", str(RECOVER_POLICY), "--lora-rank", "8", "--lr", "1e-3"]):
        result = runner.invoke(app, ["demo", "--run-dir", str(tmp_path / "demo"), *args])
        assert result.exit_code == 0, result.output
    default, given = started
    assert (default.collect.model, default.train.lora_rank, default.train.lr) == (str(DEFAULT_POLICY), 0, 1e-4)
    assert (given.collect.model, given.train.lora_rank, given.train.lr) == (str(RECOVER_POLICY), 8, 1e-3)
    assert (given.collect.n_prompts, given.collect.group_size, given.iterations) == (32, 8, 6)
