"""The documentation against the code it describes.

README.md is a front page (under 15,000 characters) whose CLI table lists exactly the app's
commands; every relative link of README.md and docs/*.md resolves, anchors included; and
docs/warehouse.md lists every dataset's columns, in schema order and with their Arrow types, as
`cleaner/warehouse/schema.py` declares them.

Run as a script, it prints the warehouse's column tables as docs/warehouse.md should hold them,
each column's description kept from the page (new columns get an empty one):
`.venv/bin/python tests/test_docs.py`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pyarrow as pa

from cleaner.warehouse import schema
from tests.helpers import leaf_commands

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WAREHOUSE_DOC = ROOT / "docs" / "warehouse.md"
README_LIMIT = 15_000

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a link or a heading there is neither)."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped,
    spaces as hyphens, a repeated one suffixed -1, -2, ..."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(prose(text)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").replace("*", "").lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of `text`, up to the next heading of that level or above."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in `text`, cells stripped (`|` inside backticks kept)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip())[1:-1]]
        rows.append(cells)
    return [row for row in rows[1:] if not all(set(cell) <= set("-: ") for cell in row)]


# ---------------------------------------------------------------------------------------------
# README


def test_readme_is_a_front_page():
    assert len(README.read_text()) < README_LIMIT


def test_readme_cli_table_lists_exactly_the_commands():
    documented = []
    for cells in table_rows(section(README.read_text(), "CLI")):
        words = cells[0].strip("`").split()
        assert words[0] == "cleaner", cells
        documented.append(" ".join(word for word in words[1:] if re.fullmatch(r"[a-z][a-z-]*", word)))
    assert len(documented) == len(set(documented))
    assert sorted(documented) == sorted(" ".join(path) for path, _ in leaf_commands())


def test_readme_names_the_commands_that_take_warehouse():
    match = re.search(r"The commands that read or write a warehouse\s+\(([^)]*)\)", README.read_text())
    assert match, "README lost its sentence on --warehouse"
    named = {name.strip() for name in match.group(1).replace("\n", " ").split(",")}
    taking = {" ".join(path) for path, command in leaf_commands()
              if any("--warehouse" in param.opts for param in command.params)}
    assert named == taking


# ---------------------------------------------------------------------------------------------
# Links


def test_every_relative_link_resolves():
    broken = []
    for page in markdown_files():
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_anchors_follow_github():
    assert anchors("# One `cleaner run` on many ranks\n## SGLang: what ran, and the CPU recipe\n## x\n## x\n") \
        == {"one-cleaner-run-on-many-ranks", "sglang-what-ran-and-the-cpu-recipe", "x", "x-1"}
    assert anchors("```\n# not a heading\n```\n### `purify_configs`\n") == {"purify_configs"}


# ---------------------------------------------------------------------------------------------
# The warehouse's columns


def type_name(type_: pa.DataType) -> str:
    """An Arrow type as docs/warehouse.md writes it: list<int32>, map<int32, float64>, timestamp[us]."""
    if pa.types.is_list(type_):
        return f"list<{type_name(type_.value_type)}>"
    if pa.types.is_map(type_):
        return f"map<{type_name(type_.key_type)}, {type_name(type_.item_type)}>"
    return {"float": "float32", "double": "float64"}.get(str(type_), str(type_))


def documented_datasets(text: str) -> dict[str, list[list[str]]]:
    """Each `### `dataset`` section of the page: its column table's rows (column, type, description),
    or the rows of the dataset it says it has the same columns as."""
    found: dict[str, list[list[str]]] = {}
    same: dict[str, str] = {}
    sections = re.split(r"^### ", section(prose(text), "Datasets and their columns"), flags=re.MULTILINE)[1:]
    for body in sections:
        names = re.findall(r"`(\w+)`", body.splitlines()[0])
        rows = table_rows(body)
        for name in names:
            if rows:
                found[name] = [[cells[0].strip("`"), cells[1].strip("`"), cells[2]] for cells in rows]
            else:
                match = re.search(rf"`{name}` has the columns of `(\w+)`", body)
                assert match, f"### `{name}` has neither a column table nor 'the columns of'"
                same[name] = match.group(1)
    for name, other in same.items():
        found[name] = found[other]
    return found


def expected_rows(dataset: schema.Dataset) -> list[tuple[str, str]]:
    return [(field.name, type_name(field.type)) for field in dataset.schema]


def test_documented_columns_match_the_schema():
    documented = documented_datasets(WAREHOUSE_DOC.read_text())
    assert sorted(documented) == sorted(schema.DATASETS)
    for name, dataset in schema.DATASETS.items():
        assert [(column, type_) for column, type_, _ in documented[name]] == expected_rows(dataset), (
            f"docs/warehouse.md's {name} columns differ from schema.py: run tests/test_docs.py for the table")
        assert all(description for _, _, description in documented[name]), name


def test_documented_layout_matches_the_partitions():
    layout = FENCE.search(WAREHOUSE_DOC.read_text()).group(0)
    placeholder = {"iteration": "<i>", "config": "<config_id>", "eval": "<eval_id>"}
    for name, dataset in schema.DATASETS.items():
        keys = "".join(f"{key}={placeholder[key]}/" for key in dataset.partition_keys)
        assert f"<warehouse>/{name}/{keys}part-<uuid>.parquet" in layout, name


def test_the_parsers_read_what_they_should():
    page = ("## Datasets and their columns\n\n### `a`\n\n| column | type | meaning |\n| --- | --- | --- |\n"
            "| `x` | `list<int32>` | one `a|b` thing |\n| `y` | `bool` | z |\n\n"
            "### `b`\n\n`b` has the columns of `a`.\n")
    rows = [["x", "list<int32>", "one `a|b` thing"], ["y", "bool", "z"]]
    assert documented_datasets(page) == {"a": rows, "b": rows}
    assert type_name(schema.PURIFIED.schema.field("loss_mask").type) == "list<int8>"
    assert type_name(schema.EVAL_RUNS.schema.field("pass_at_k").type) == "map<int32, float64>"


def print_tables() -> None:
    """Print every dataset's column table, descriptions kept from docs/warehouse.md."""
    documented = documented_datasets(WAREHOUSE_DOC.read_text())
    for name, dataset in schema.DATASETS.items():
        first = next(other for other in schema.DATASETS.values() if other.schema.equals(dataset.schema))
        if first is not dataset:
            print(f"### `{name}`\n\n`{name}` has the columns of `{first.name}`.\n")
            continue
        descriptions = {column: description for column, _, description in documented.get(name, [])}
        print(f"### `{name}`\n\n| column | type | meaning |\n| --- | --- | --- |")
        for column, type_ in expected_rows(dataset):
            print(f"| `{column}` | `{type_}` | {descriptions.get(column, '')} |")
        print()


if __name__ == "__main__":
    print_tables()
