"""The sandbox package's shape: a leaf tool with no module state, its worker started from the
installed package.

Checked on the source (with `ast`), so an import hidden inside a function counts as much as one at
the top of a module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import cleaner.sandbox
from cleaner.sandbox import LocalSandbox, SandboxConfig, pool, usercode

PACKAGE_DIR = Path(cleaner.sandbox.__file__).parent
MODULES = sorted(PACKAGE_DIR.glob("*.py"))
UPPER_LAYERS = ("cleaner.engine", "cleaner.config", "cleaner.cli", "cleaner.loop", "cleaner.report", "cleaner.toys")


def imported_modules(path: Path) -> list[str]:
    """Every module an `import` or `from ... import` in the file names (relative ones as '.x')."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_the_package_has_the_modules_it_documents():
    assert {path.stem for path in MODULES} >= {"config", "outcome", "protocol", "isolation", "worker",
                                               "child", "usercode", "docker_backend", "pool"}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_module_imports_an_upper_layer(path):
    upward = [name for name in imported_modules(path)
              if any(name == layer or name.startswith(layer + ".") for layer in UPPER_LAYERS)]
    assert upward == []


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_global_statement(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Global | ast.Nonlocal)] == []


def test_usercode_is_standard_library_only():
    """Docker runs its source text with a bare `python -c`: no package, no third-party module."""
    names = imported_modules(Path(usercode.__file__))
    assert [name for name in names if name.split(".")[0] not in sys.stdlib_module_names] == []


def test_worker_command_is_the_installed_module_with_no_cwd(monkeypatch):
    calls = []

    class Recorded(Exception):
        pass

    def record(command, **options):
        calls.append((command, options))
        raise Recorded

    monkeypatch.setattr(pool.subprocess, "Popen", record)
    config = SandboxConfig(workers=1, preload_scientific=False)
    with pytest.raises(Recorded):
        LocalSandbox(config)
    ((command, options),) = calls
    assert command == [sys.executable, "-P", "-m", "cleaner.sandbox.worker", config.to_json(), "-"]
    assert "cwd" not in options


def test_a_worker_starts_from_any_directory_whatever_it_holds(tmp_path, monkeypatch):
    """A decoy `cleaner` package and `json` module in the caller's directory are not imported."""
    decoy = tmp_path / "cleaner"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise RuntimeError('decoy cleaner imported')")
    (tmp_path / "json.py").write_text("raise RuntimeError('decoy json imported')")
    monkeypatch.chdir(tmp_path)
    with LocalSandbox(SandboxConfig(workers=1, preload_scientific=False)) as sandbox:
        result = sandbox.run("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n")
