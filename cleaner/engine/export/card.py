"""The exported folder's `README.md`, a Hugging Face dataset card (docs/architecture.md §15).

Design decisions:
- The YAML front matter is what the Hub and `datasets.load_dataset` read: one `default` config
  whose `train` split is `data/train-*`, the features derived from the format's Arrow schema
  (folder.py) as `datasets` itself writes them, the split's row count, tags. JSON Lines carry no
  declared features: `datasets` reads their shape from the lines.
- The text says what was exported and from where, so a folder found later explains itself: the
  warehouse, iterations, filter, view, purify config and SAAR settings, policies, the counts (rows,
  exact conversations, pairs by depth and error type, the SQL count the pairs must equal), and
  how to load it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import yaml

from cleaner.engine.export.folder import MESSAGES, PREFERENCE, SPLIT, schema_of

_DTYPES = {"extension<arrow.json>": "json", "float": "float32", "double": "float64"}


@dataclass(frozen=True)
class CardFacts:
    """What a card states."""

    warehouse: Path
    form: str
    pairs: str | None  # preference: chain or outcome
    view: str
    iterations: tuple[int, ...]
    where: str | None
    config: str | None  # the purify config, with its SAAR settings, as a sentence
    policies: tuple[str, ...]
    selected: int  # rollouts selected
    rows: int
    data_bytes: int  # the rows' size as `datasets` counts a split's bytes
    shards: int
    exact: int | None  # conversations rendered back exactly
    counted: int | None  # pairs by the documented SQL count
    kinds: Counter  # pairs by depth, or outcome pairs by exactness
    errors: Counter  # chain pairs by error type
    untrained: int = 0  # purified view: rollouts the config trains nothing of, left out


def features_yaml(schema: pa.Schema) -> list[dict]:
    """The `dataset_info.features` list of a card, as `datasets` writes one."""
    return [_feature(field.name, field.type) for field in schema]


def _feature(name: str, type_: pa.DataType) -> dict:
    return {"name": name, **_shape(type_)}


def _shape(type_: pa.DataType) -> dict:
    """A feature's shape as `datasets` writes it: a list of structs lists their features, a list of
    anything else its element's shape (`{"list": "int64"}`, `{"list": {"list": "string"}}`)."""
    if pa.types.is_list(type_):
        inner = type_.value_type
        if pa.types.is_struct(inner):
            return {"list": [_feature(f.name, f.type) for f in inner]}
        shape = _shape(inner)
        return {"list": shape.get("dtype", shape)}
    if pa.types.is_struct(type_):
        return {"struct": [_feature(f.name, f.type) for f in type_]}
    return {"dtype": _DTYPES.get(str(type_), str(type_))}


def card(facts: CardFacts) -> str:
    """README.md: the YAML front matter, then the text."""
    info: dict = {"splits": [{"name": SPLIT, "num_bytes": facts.data_bytes, "num_examples": facts.rows}]}
    if facts.form != MESSAGES:
        info = {"features": features_yaml(schema_of(facts.form)), **info}
    front = {
        "configs": [{"config_name": "default", "data_files": [{"split": SPLIT, "path": f"data/{SPLIT}-*"}]}],
        "dataset_info": info,
        "tags": ["cleaner", "tool-use", "agent", "dpo" if facts.form == PREFERENCE else "sft"],
    }
    return f"---\n{yaml.safe_dump(front, sort_keys=False, allow_unicode=True)}---\n\n{_text(facts)}"


def _text(facts: CardFacts) -> str:
    what = f"{facts.form} ({facts.pairs} pairs)" if facts.form == PREFERENCE else facts.form
    lines = [
        "# Trajectories exported by cleaner", "",
        f"`cleaner export` wrote {facts.rows:,} rows in {facts.shards} shard(s) of format **{what}** from "
        f"the warehouse `{facts.warehouse}`.", "",
        f"- iterations: {', '.join(map(str, facts.iterations))}",
        f"- filter (`--where`): {f'`{facts.where}`' if facts.where else 'none'}",
        f"- rollouts selected: {facts.selected:,}",
        *([f"- rollouts left out, their purified rows training nothing (down-sampled out, or masked by the "
           f"void-turn filter): {facts.untrained:,}"] if facts.untrained else []),
        f"- view: {facts.view}",
        f"- purify config: {facts.config or 'none'}",
        f"- policies (tokenizer and chat template): {', '.join(f'`{p}`' for p in facts.policies)}",
    ]
    if facts.exact is not None:
        lines.append(f"- conversations the policy's chat template renders back to the stored token ids "
                     f"(`exact`): {facts.exact:,} of {facts.rows:,}")
    if facts.counted is not None:
        lines.append(f"- pairs by the warehouse's SQL count: {facts.counted:,} (rows: {facts.rows:,})")
    lines += [f"- pairs {kind}: {count:,}" for kind, count in sorted(facts.kinds.items())]
    lines += [f"- pairs failing with {error}: {count:,}" for error, count in facts.errors.most_common()]
    lines += ["", "Load it with `datasets.load_dataset(\"<this folder>\", split=\"train\")`; every column is "
              "described in cleaner's docs/export.md.", ""]
    return "\n".join(lines)
