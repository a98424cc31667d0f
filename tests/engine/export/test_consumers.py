"""The exported folders read by their real consumers, offline (the export-test extra): `datasets`
loads each format with the features its card declares, TRL's own predicates accept the rows with
the tiny policy's template, and one SFTTrainer step and one DPOTrainer step run on the CPU on the
tiny policy from the folders."""

from __future__ import annotations

import json
import os

import pytest

from cleaner.config import DEFAULT_POLICY
from cleaner.engine.export.job import ExportRequest, export_job
from cleaner.warehouse import Warehouse

datasets = pytest.importorskip("datasets", reason="needs the export-test extra (datasets, trl)")
trl = pytest.importorskip("trl", reason="needs the export-test extra (datasets, trl)")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub call, no cache outside the test's folder."""
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "HF_DATASETS_CACHE": str(tmp_path / "cache"), "WANDB_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def folders(small_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("exported")
    # the run's own config, iteration 0's only one (iteration 1 was purified under two more)
    ((config_id,),) = Warehouse(small_run / "warehouse").connect().sql(
        "SELECT DISTINCT config_id FROM purified WHERE iteration = 0").fetchall()
    made = {}
    for name, changes in {"sft": {"form": "sft"}, "preference": {"form": "preference"},
                          "outcome": {"form": "preference", "pairs": "outcome"}, "messages": {"form": "messages"}}.items():
        request = ExportRequest(iterations=(0, 1), out=root / name, config_id=config_id, **changes)
        made[name] = export_job(Warehouse(small_run / "warehouse"), request, progress=False)
    return made


def _load(folder):
    return datasets.load_dataset(str(folder), split="train", cache_dir=os.environ["HF_DATASETS_CACHE"])


@pytest.mark.parametrize("name", ["sft", "preference", "outcome", "messages"])
def test_load_dataset_reads_each_format_as_its_card_says(folders, name):
    import yaml

    outcome = folders[name]
    loaded = _load(outcome.out)
    assert loaded.num_rows == outcome.rows > 0
    front = yaml.safe_load((outcome.out / "README.md").read_text().split("---")[1])
    (split,) = front["dataset_info"]["splits"]
    assert (split["name"], split["num_examples"]) == ("train", outcome.rows) and split["num_bytes"] > 0
    assert loaded.info.splits["train"].num_examples == outcome.rows  # the card's splits were read, not ignored
    if name != "messages":  # the card declares what the shards hold (datasets casts to the card's features)
        import pyarrow.parquet as pq

        written = datasets.Features.from_arrow_schema(pq.read_schema(next((outcome.out / "data").iterdir())))
        assert datasets.Features._from_yaml_list(front["dataset_info"]["features"]) == written == loaded.features
    key = "messages" if name in ("sft", "messages") else "prompt"
    assert trl.data_utils.is_conversational(loaded[0]) and loaded[0][key][0]["role"] in ("system", "user")


def test_trl_renders_sft_and_preference_rows_with_the_tiny_template(folders):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
    sft = _load(folders["sft"].out)
    row = next(row for row in sft if any(m["tool_calls"] for m in row["messages"]))
    call = next(m for m in row["messages"] if m["tool_calls"])["tool_calls"][0]
    assert isinstance(call["function"]["arguments"], dict)  # a Json feature: an object, as templates take it
    text = trl.data_utils.maybe_apply_chat_template(row, tokenizer, tools=row["tools"])["text"]
    assert "<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": " in text
    assert "<|im_start|>user\n<tool_response>\n" in text
    pair = _load(folders["preference"].out)[0]
    rendered = trl.data_utils.maybe_apply_chat_template(
        {key: pair[key] for key in ("prompt", "chosen", "rejected")}, tokenizer, tools=pair["tools"])
    assert rendered["prompt"].endswith("<|im_start|>assistant\n")
    assert rendered["chosen"] != rendered["rejected"] and "<tool_call>" in rendered["rejected"]


def _tiny_args(config_class, tmp_path, **extra):
    return config_class(output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=2,
                        learning_rate=1e-4, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                        dataloader_num_workers=0, max_length=512, **extra)


def test_one_sft_step_on_the_tiny_policy_from_the_folder(folders, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dataset = _load(folders["sft"].out).select(range(4))
    trainer = trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY),
                             args=_tiny_args(trl.SFTConfig, tmp_path), train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(DEFAULT_POLICY))
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0


def test_one_dpo_step_on_the_tiny_policy_from_the_folder(folders, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dataset = _load(folders["preference"].out).select(range(2))
    trainer = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY),
                             args=_tiny_args(trl.DPOConfig, tmp_path), train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(DEFAULT_POLICY))
    result = trainer.train()
    assert result.global_step == 1
    assert json.loads(json.dumps(trainer.state.log_history[0]))["loss"] == pytest.approx(0.6931, abs=0.05)
