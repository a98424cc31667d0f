"""curate against the paper's own filter, given its checkout (CLEANER_REFERENCE=path to Open-CLEANER):
`filter_dataset_by_statistics.py`'s `filter_dataset` and `get_data_category` run on the statistics it
ships (30,128 prompts, 8 rollouts each of Qwen2.5-7B-RA-SFT) over a dataset whose row i has uid i, and
cleaner's filter keeps the same rows, with and without retain_code, under data_filter.sh's ratios."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from cleaner.engine.curate.filtering import CATEGORY_NAMES, category_of, match_rows, select
from cleaner.engine.curate.ratios import parse_ratios
from cleaner.engine.curate.stats import read_stats

REFERENCE = os.environ.get("CLEANER_REFERENCE")
STATS = "dataset/Open-AgentRL-30K/Open-AgentRL-30K.filtered.parquet.success.jsonl"
RATIOS = "0.0:0.0,0.125:0.8,0.25:0.9,0.375:1.0,0.5:1,0.625:1,0.75:1,0.875:1,1.0:0.0"  # data_filter.sh's

pytestmark = pytest.mark.skipif(REFERENCE is None, reason="CLEANER_REFERENCE (an Open-CLEANER checkout) not set")


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("pandas")
    path = Path(REFERENCE) / "filter_dataset_by_statistics.py"
    spec = importlib.util.spec_from_file_location("reference_filter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_categories_are_the_references(reference):
    stats = read_stats(Path(REFERENCE) / STATS)
    sources = {item.data_source for item in stats} | {name for _, names in CATEGORY_NAMES for name in names}
    sources |= {"MBPP", "ma", "algebr", "toy", "unknown", "code_of_physics", "GPQA-Diamond", "aime25"}
    assert {source: category_of(source) for source in sources} == {
        source: reference.get_data_category(source) for source in sources}


@pytest.mark.parametrize("retain_code", [False, True])
def test_the_same_prompts_are_kept_as_the_reference_keeps(reference, retain_code):
    import pandas as pd

    stats = read_stats(Path(REFERENCE) / STATS)
    uids = [str(row) for row in range(len(stats))]
    by_uid = {item.uid: item for item in stats}
    frame = pd.DataFrame({"uid": uids, "data_source": [by_uid[uid].data_source for uid in uids]})
    spec = parse_ratios(RATIOS)
    ratios = {float(rate): ratio for rate, ratio in spec.pairs}
    stats_dict = reference.load_statistics(Path(REFERENCE) / STATS)
    kept, _ = reference.filter_dataset(frame, stats_dict, {"success_rate_ratios": ratios}, retain_code=retain_code)
    selection = select(match_rows(uids, list(frame["data_source"]), stats),
                       spec.resolve([8], [item.rate for item in stats]), retain_code)
    assert [uids[row] for row in selection.kept_rows] == list(kept["uid"])
    assert len(selection.kept_rows) == (15_640 if retain_code else 15_353)
