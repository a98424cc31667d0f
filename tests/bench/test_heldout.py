"""bench/heldout.py: the held-out problems, their disjointness checks and the paired table."""

from __future__ import annotations

import math

import polars as pl
import pytest
from heldout import (
    HELDOUT_SEED,
    corpus_problems,
    heldout_markdown,
    heldout_paired,
    overlapping,
    write_heldout,
)

from cleaner.config import PromptStyle
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.tasks import toy_problem, toy_tasks
from cleaner.toys.corpus import CORPUS_SEED_OFFSET


def test_heldout_file_reads_back_as_the_bare_toy_questions(tmp_path):
    questions = write_heldout(tmp_path / "heldout.parquet", 5)
    tasks = load_dataset(tmp_path / "heldout.parquet", PromptStyle.BARE).tasks
    expected = toy_tasks(5, HELDOUT_SEED)
    assert questions == [t.messages[-1]["content"] for t in expected]
    assert [t.messages[-1]["content"] for t in tasks] == questions  # the question alone, as trained
    assert [t.ground_truth for t in tasks] == [t.ground_truth for t in expected]


def test_overlapping_finds_a_question_inside_a_rendered_prompt():
    texts = ["<|im_start|>user\nWhat is (1 * 2 + 3) mod 4?<|im_end|>\n<|im_start|>assistant\n"]
    assert overlapping(["What is (1 * 2 + 3) mod 4?", "What is (1 * 2 + 3) mod 5?"], texts) == [
        "What is (1 * 2 + 3) mod 4?"]
    assert overlapping(["Compute (1 * 2 + 3) mod 4."], texts) == []


def test_corpus_problems_hold_every_bootstrap_corpus():
    problems = corpus_problems()
    first = toy_problem(5 + CORPUS_SEED_OFFSET, 0)  # tiny-policy-recover's corpus: seed 5, 12000 problems
    last = toy_problem(5 + CORPUS_SEED_OFFSET, 11999)
    assert {(first.a, first.b, first.c, first.d), (last.a, last.b, last.c, last.d)} <= problems
    held = {(p.a, p.b, p.c, p.d) for p in (toy_problem(HELDOUT_SEED, i) for i in range(256))}
    assert not held & problems


def test_heldout_paired_differences_are_taken_seed_by_seed():
    rows = [("initial", None, False, 0.50), ("baseline", 0, False, 0.60), ("baseline", 1, False, 0.70),
            ("mask", 0, False, 0.70), ("mask", 1, False, 0.70), ("baseline", 0, True, 0.65), ("mask", 0, True, 0.60)]
    frame = pl.DataFrame([{"arm": arm, "seed": seed, "saar": saar, "accuracy": accuracy,
                           "failures_per_trajectory": 0.1, "truncation_rate": 0.2}
                          for arm, seed, saar, accuracy in rows], schema_overrides={"seed": pl.Int64})
    table = {(r["arm"], r["saar"]): r for r in heldout_paired(frame, ["baseline", "mask"]).iter_rows(named=True)}
    assert table["initial", False]["accuracy"] == 0.5 and table["initial", False]["d_accuracy"] is None
    mask = table["mask", False]
    assert mask["accuracy"] == pytest.approx(0.70)
    assert mask["d_accuracy"] == pytest.approx(0.05)  # +0.10 on seed 0, 0.00 on seed 1
    assert mask["sd_accuracy"] == pytest.approx(math.sqrt(2 * 0.05**2))
    assert (mask["seeds_above"], mask["seeds"]) == (1, 2)
    assert table["mask", True]["d_accuracy"] == pytest.approx(-0.05)
    # one seed has no spread: '-', not a false 0
    assert "| mask | SAAR | 0.600 | -0.050 ± - | 0/1 |" in heldout_markdown(heldout_paired(frame, ["baseline", "mask"]))
    assert list(table) == [("initial", False), ("baseline", False), ("baseline", True), ("mask", False), ("mask", True)]
