"""The dataset card by hand (cleaner/engine/export/card.py): its front matter against what `datasets`
itself writes, and its text word for word, without a warehouse."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from cleaner.engine.export.card import CardFacts, card, features_yaml
from cleaner.engine.export.folder import MESSAGES, PREFERENCE, SFT, schema_of

datasets = pytest.importorskip("datasets", reason="needs the export-test extra (datasets, trl)")

# a schema with every shape the card's features take: nested lists of structs, structs, JSON, floats
SHAPES = pa.schema([("a", pa.float64()), ("b", pa.float32()), ("c", pa.struct([("x", pa.int32()), ("y", pa.json_())])),
                    ("d", pa.list_(pa.struct([("z", pa.list_(pa.struct([("w", pa.string())])))]))),
                    ("e", pa.list_(pa.int64())), ("f", pa.bool_()), ("g", pa.list_(pa.list_(pa.string()))),
                    ("h", pa.struct([("l", pa.list_(pa.float32()))]))])


def _facts(**changes) -> CardFacts:
    facts = dict(warehouse=Path("/w/wh"), form=PREFERENCE, pairs="chain", view="purified", iterations=(0, 2),
                 where="reward > 0", config="abc123 (gamma 0.5, p 1.0)", policies=("/p/one", "/p/two"), selected=1234,
                 rows=1500, data_bytes=98765, shards=2, exact=1499, counted=1500,
                 kinds=Counter({"shallow": 1000, "deep": 500}), errors=Counter({"NameError": 3, "KeyError": 9}),
                 untrained=7)
    return CardFacts(**(facts | changes))


def test_a_cards_features_are_what_datasets_writes_for_the_schema():
    for schema in (schema_of(SFT), schema_of(PREFERENCE), SHAPES):
        assert features_yaml(schema) == datasets.Features.from_arrow_schema(schema)._to_yaml_list()


def test_a_preference_card_says_what_was_exported_from_where_word_for_word():
    text = card(_facts())
    front, body = text.removeprefix("---\n").split("---\n\n", 1)
    assert yaml.safe_load(front) == {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*"}]}],
        "dataset_info": {"features": features_yaml(schema_of(PREFERENCE)),
                         "splits": [{"name": "train", "num_bytes": 98765, "num_examples": 1500}]},
        "tags": ["cleaner", "tool-use", "agent", "dpo"]}
    assert list(yaml.safe_load(front)) == ["configs", "dataset_info", "tags"]  # as the Hub's cards order them
    assert list(yaml.safe_load(front)["dataset_info"]) == ["features", "splits"]
    assert front.startswith("configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n")
    assert list(yaml.safe_load(front)["dataset_info"]["features"][0]) == ["name", "list"]  # as datasets writes them
    assert body == """# Trajectories exported by cleaner

`cleaner export` wrote 1,500 rows in 2 shard(s) of format **preference (chain pairs)** from the warehouse `/w/wh`.

- iterations: 0, 2
- filter (`--where`): `reward > 0`
- rollouts selected: 1,234
- rollouts left out, their purified rows training nothing (down-sampled out, or masked by the void-turn filter): 7
- view: purified
- purify config: abc123 (gamma 0.5, p 1.0)
- policies (tokenizer and chat template): `/p/one`, `/p/two`
- conversations the policy's chat template renders back to the stored token ids (`exact`): 1,499 of 1,500
- pairs by the warehouse's SQL count: 1,500 (rows: 1,500)
- pairs deep: 500
- pairs shallow: 1,000
- pairs failing with KeyError: 9
- pairs failing with NameError: 3

Load it with `datasets.load_dataset("<this folder>", split="train")`; every column is described in cleaner's \
docs/export.md.
"""


def test_an_sft_card_without_a_filter_config_or_counts_says_none_and_a_messages_card_declares_no_features():
    body = card(_facts(form=SFT, pairs=None, where=None, config=None, exact=None, counted=None, kinds=Counter(),
                       errors=Counter(), untrained=0, policies=("/p/one",), iterations=(3,)))
    front, text = body.removeprefix("---\n").split("---\n\n", 1)
    assert yaml.safe_load(front)["tags"] == ["cleaner", "tool-use", "agent", "sft"]
    assert yaml.safe_load(front)["dataset_info"]["features"] == features_yaml(schema_of(SFT))
    assert text.splitlines()[2:11] == [
        "`cleaner export` wrote 1,500 rows in 2 shard(s) of format **sft** from the warehouse `/w/wh`.", "",
        "- iterations: 3", "- filter (`--where`): none", "- rollouts selected: 1,234", "- view: purified",
        "- purify config: none", "- policies (tokenizer and chat template): `/p/one`", ""]
    messages = yaml.safe_load(card(_facts(form=MESSAGES, pairs=None)).removeprefix("---\n").split("---\n\n")[0])
    assert messages["dataset_info"] == {"splits": [{"name": "train", "num_bytes": 98765, "num_examples": 1500}]}
    assert messages["tags"][-1] == "sft"
    assert "format **messages**" in card(_facts(form=MESSAGES, pairs="chain"))
    unicode = card(_facts(where="note = 'é'"))
    assert "`note = 'é'`" in unicode
