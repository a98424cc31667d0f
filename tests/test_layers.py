"""The architecture as tests (docs/architecture.md §2): imports point down the layers, comments
point into the repository, and the closed sets are spelled once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cleaner"


def _modules(under: str = "") -> list[Path]:
    return sorted((PACKAGE / under).rglob("*.py"))


def _imports(path: Path) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, inside a function) for every import of `path`."""
    tree = ast.parse(path.read_text())
    inner = {id(node) for func in ast.walk(tree) if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
             for node in ast.walk(func) if isinstance(node, ast.Import | ast.ImportFrom)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node, node.module, id(node) in inner))
        elif isinstance(node, ast.Import):
            found += [(node, alias.name, id(node) in inner) for alias in node.names]
    return found


def test_engine_imports_inside_functions_say_why():
    """An import inside a function is for start-up time or an optional extra, with a comment."""
    silent = []
    for path in _modules("engine"):
        lines = path.read_text().splitlines()
        for node, module, inner in _imports(path):
            if inner and "#" not in lines[node.lineno - 1]:
                silent.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {module}")
    assert silent == []


def test_lower_layers_do_not_import_upper_ones():
    upper = ("cleaner.cli", "cleaner.loop")
    for path in _modules("engine") + _modules("warehouse"):
        assert not [m for _, m, _ in _imports(path) if m.startswith(upper)], path
    for path in _modules("warehouse"):  # the warehouse knows records and errors, no stage
        allowed = ("cleaner.warehouse", "cleaner.records", "cleaner", "cleaner.errors")
        assert all(m in allowed or not m.startswith("cleaner") or m.startswith(allowed[0])
                   for _, m, _ in _imports(path)), path


def test_no_comment_points_outside_the_repository():
    for path in _modules():
        assert "DESIGN.md" not in path.read_text(), path


def test_closed_sets_are_not_spelled_by_hand():
    """Finish reasons and tool statuses are compared through their enums, not string literals."""
    literal = re.compile(r'[=!]= "(max_turns|max_tokens|answer|infra_error|format_error|timeout)"')
    for path in _modules():
        assert not literal.search(path.read_text()), path
