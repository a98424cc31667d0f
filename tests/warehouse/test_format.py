"""The warehouse's format version and its migration steps (warehouse/format.py): what the identity
file records, and what an earlier format's stored configs read as."""

from __future__ import annotations

import json

from cleaner.config import TrainConfig
from cleaner.config.layers import resolve_run_config
from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.format import FORMAT_VERSION
from cleaner.warehouse.parts import write_part
from tests.factories import as_format_1, make_rollout, make_segments

# A train table as format 1 stored it: rollout correction's token level was `truncated_is` and its cap
EARLIER_TRAIN = {"truncated_is": True, "is_cap": 3.0, "lr": 1e-5}


def test_a_new_warehouse_records_this_format_and_one_with_older_parts_format_1(tmp_path):
    fresh = Warehouse(tmp_path / "fresh")
    fresh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    assert json.loads((fresh.root / ".warehouse.json").read_text())["format"] == FORMAT_VERSION == 2
    assert Warehouse(fresh.root).format_version() == 2
    assert Warehouse(tmp_path / "none").format_version() == 1  # nothing recorded: what main wrote
    as_format_1(fresh.root)
    assert Warehouse(fresh.root).format_version() == 1
    older = tmp_path / "older"  # parts an older cleaner wrote, unstamped: a write claims it as format 1
    write_part(older / "rollouts" / "iteration=0", schema.to_table(schema.ROLLOUTS, [make_rollout("r0")]), "part-old.parquet")
    Warehouse(older).write_rollouts(1, [make_rollout("r1", 1)], make_segments("r1", 1))
    assert json.loads((older / ".warehouse.json").read_text())["format"] == 1


def test_a_format_1_warehouses_train_tables_read_in_this_formats_fields(tmp_path):
    warehouse = Warehouse(tmp_path / "warehouse")
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    warehouse.save_config("run", json.dumps({"iterations": 2, "train": EARLIER_TRAIN}))
    warehouse.save_config("train-iteration=0", json.dumps(EARLIER_TRAIN))
    assert "truncated_is" in warehouse.load_config("run")  # format 2: read as stored
    as_format_1(warehouse.root)
    earlier = Warehouse(warehouse.root)
    run = resolve_run_config(json.loads(earlier.load_config("run")))
    trained = TrainConfig.from_json(earlier.load_config("train-iteration=0"))
    for config in (run.train, trained):
        assert (config.rollout_is, config.rollout_is_threshold, config.lr) == ("token", 3.0, 1e-5)
    untouched = json.dumps({"lr": 1e-5, "rollout_is": "sequence"})  # already this format's: as it was
    earlier.save_config("train-iteration=1", untouched)
    assert earlier.load_config("train-iteration=1") == untouched
