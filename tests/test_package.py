"""The package as a library user gets it (cleaner/__init__.py): `import cleaner` loads no torch, every
public name resolves to the object its module defines, `__version__` and `cleaner --version` are the
installed distribution's. The slow test builds the wheel and runs the demo from it, outside the
checkout, in a fresh virtual environment."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cleaner
from cleaner.cli import app

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# The Makefile's TORCH_SPEC: the CPU wheel; an unpinned torch pulls GBs of CUDA libraries.
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")


def test_importing_cleaner_loads_no_torch_and_no_module_of_its_own():
    code = ("import sys, cleaner\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pyarrow', 'duckdb', 'polars')"
            " or m.startswith('cleaner.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_all_lists_the_exported_names_once():
    assert sorted(cleaner.__all__) == sorted({"__version__", *cleaner._EXPORTS})


@pytest.mark.parametrize("name", cleaner._EXPORTS)
def test_every_public_name_resolves_to_its_modules_object(name):
    assert name in dir(cleaner)
    assert getattr(cleaner, name) is getattr(importlib.import_module(cleaner._EXPORTS[name]), name)


def test_the_public_names_are_what_a_library_user_needs():
    for name in ("CollectConfig", "PurifyConfig", "TrainConfig", "EvalConfig", "RunConfig", "Rollout", "Segment",
                 "PurifiedRow", "Warehouse", "collect_job", "purify_job", "train_job", "eval_job", "report_job",
                 "run_loop", "load_backend", "CleanerError", "__version__"):
        assert name in cleaner.__all__
    namespace: dict = {}
    exec("from cleaner import *", namespace)
    assert set(cleaner.__all__) <= set(namespace)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'cleaner' has no attribute 'collect'"):
        cleaner.collect  # noqa: B018


def test_the_version_is_the_installed_distributions():
    assert cleaner.__version__ == metadata.version("cleaner") == PYPROJECT_VERSION
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"cleaner {PYPROJECT_VERSION}\n")


def test_a_source_checkout_never_installed_reads_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert cleaner._version() == PYPROJECT_VERSION
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "cleaner"\nversion = "9.8.7"\n')
    assert cleaner._source_version(tmp_path / "pyproject.toml") == "9.8.7"
    assert cleaner._source_version(tmp_path / "missing.toml") == "0+unknown"
    (tmp_path / "pyproject.toml").write_text("[project\n")
    assert cleaner._source_version(tmp_path / "pyproject.toml") == "0+unknown"


# ---------------------------------------------------------------------------------------------
# The wheel


def _run(command: list, cwd: Path, env: dict[str, str], timeout_s: int) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_the_wheel_runs_the_demo_outside_the_checkout(tmp_path):
    """`pip wheel . --no-deps` (on a copy of what the wheel is built from, so the checkout gets no
    build/), installed with the pinned CPU torch into a fresh venv; then, from a directory outside
    the checkout, `cleaner --version` and a one-iteration demo on the packaged tiny policy."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    source = tmp_path / "source"
    shutil.copytree(ROOT / "cleaner", source / "cleaner", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", tmp_path / "wheels"], source, env, 300)
    (wheel,) = (tmp_path / "wheels").glob("cleaner-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {"cleaner/py.typed", "cleaner/assets/tiny-policy/model.safetensors",
            "cleaner/assets/tiny-policy/tokenizer.json", "cleaner/ui/templates/base.html"} <= shipped

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, env, 120)
    _run([venv / "bin/python", "-m", "pip", "install", "-q", TORCH_SPEC, wheel], tmp_path, env, 900)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert _run([venv / "bin/cleaner", "--version"], outside, env, 60).stdout == f"cleaner {PYPROJECT_VERSION}\n"
    where = _run([venv / "bin/python", "-c", "import cleaner; print(cleaner.__file__)"], outside, env, 60)
    assert Path(where.stdout.strip()).is_relative_to(venv)  # the installed copy, not the checkout

    demo = _run([venv / "bin/cleaner", "demo", "--iterations", "1", "--prompts", "2"], outside, env, 600)
    assert "report: runs/demo/report/report.md" in demo.stdout
    assert (outside / "runs/demo/report/report.md").is_file()
    assert (outside / "runs/demo/warehouse/iterations").is_dir()
