"""The settings (config/settings.py): how a field counts toward its config's id (`setting`'s
identity); fields added at their default leave every stored id as it was, away from it they make a
new one; a saved config reads back; the aggregation and its constant follow the loss mode and the
budget when not given."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from cleaner.config import AdvEstimator, CollectConfig, LossMode, PurifyConfig, TrainConfig
from cleaner.config.settings import _Config, setting

MAIN_CONFIGS = Path(__file__).parents[1] / "fixtures" / "main-a9d807d" / "warehouse" / "configs"

# the ids the version before the objective settings gave these configs (git a9d807d)
MAIN_PURIFY_IDS = {"default": "a8bf93c6f605", "gamma 0.7, mask": "d27e6371d66d",
                   "negatives, absolute cap": "a055cd88791e"}
MAIN_TRAIN_ID = "186da912031c"


@dataclasses.dataclass(frozen=True)
class _Toy(_Config):
    counted: int = setting(1, help="always counts")
    added: int = setting(2, identity="away-from-default", help="counts away from its default")
    scheduling: int = setting(3, identity="never", help="never counts")


def test_each_identity_rule_decides_what_the_id_hashes():
    assert _Toy().identity() == {"counted": 1} and _Toy(added=5).identity() == {"counted": 1, "added": 5}
    assert _Toy(scheduling=9).config_id == _Toy().config_id == hashlib.sha256(b'{"counted": 1}').hexdigest()[:12]
    assert _Toy(counted=4).config_id != _Toy().config_id != _Toy(added=5).config_id
    with pytest.raises(ValueError, match="identity must be one of"):
        setting(0, identity="sometimes", help="")


@pytest.mark.parametrize(("cls", "stored"), [(CollectConfig, "collect-iteration=0"), (TrainConfig, "train-iteration=0"),
                                             (PurifyConfig, "purify-iteration=0-config=a8bf93c6f605")])
def test_a_field_mains_stored_configs_lack_counts_only_away_from_its_default(cls, stored):
    """What keeps every id main stored: a field added since counts only away from its default (or never)."""
    had = set(json.loads((MAIN_CONFIGS / f"{stored}.json").read_text()))
    always = {item.name for item in dataclasses.fields(cls) if item.metadata["identity"] == "always"}
    assert always - had == set()


def test_a_config_at_the_new_fields_defaults_keeps_the_id_it_had():
    assert PurifyConfig().config_id == MAIN_PURIFY_IDS["default"]
    assert PurifyConfig(gamma=0.7, edit="mask").config_id == MAIN_PURIFY_IDS["gamma 0.7, mask"]
    assert PurifyConfig(negative_samples=True, dpo_cap="absolute").config_id == MAIN_PURIFY_IDS["negatives, absolute cap"]
    assert TrainConfig().config_id == MAIN_TRAIN_ID
    # the same settings given explicitly are the same config
    assert PurifyConfig(adv_estimator="grpo", norm_adv_by_std=True).config_id == MAIN_PURIFY_IDS["default"]
    assert TrainConfig(loss_mode="vanilla").config_id == MAIN_TRAIN_ID


def test_where_purify_scores_is_not_part_of_its_id_and_a_config_stored_without_it_reads_at_the_defaults():
    elsewhere = PurifyConfig(backend="sglang", sglang_url="http://127.0.0.1:9", device="cuda:1", scorer_memory_gb=2.0)
    assert elsewhere.config_id == PurifyConfig().config_id == MAIN_PURIFY_IDS["default"]
    stored = (MAIN_CONFIGS / "purify-iteration=0-config=a8bf93c6f605.json").read_text()
    assert not {"backend", "sglang_url", "device", "scorer_memory_gb"} & set(json.loads(stored))
    read = PurifyConfig.from_json(stored)
    assert (read.backend, read.sglang_url, read.device, read.scorer_memory_gb) == ("torch", None, "cpu", None)
    assert read.config_id == MAIN_PURIFY_IDS["default"] and PurifyConfig.from_json(elsewhere.to_json()) == elsewhere


@pytest.mark.parametrize("changes", [{"adv_estimator": "rloo"}, {"adv_estimator": "reinforce_plus_plus_baseline"},
                                     {"norm_adv_by_std": False}])
def test_another_estimator_is_another_purify_config(changes):
    ids = {PurifyConfig().config_id, PurifyConfig(**changes).config_id}
    assert len(ids) == 2


@pytest.mark.parametrize("changes", [{"loss_mode": "gspo"}, {"loss_mode": "cispo"}, {"loss_agg_mode": "token-mean"},
                                     {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 4096}])
def test_another_objective_is_another_train_config(changes):
    assert TrainConfig(**changes).config_id != MAIN_TRAIN_ID


def test_a_saved_config_reads_back_an_earlier_ones_fields_at_their_defaults():
    config = PurifyConfig(adv_estimator="rloo", gamma=0.3)
    assert PurifyConfig.from_json(config.to_json()) == config
    earlier = {key: value for key, value in json.loads(PurifyConfig(gamma=0.3).to_json()).items()
               if key not in ("adv_estimator", "norm_adv_by_std")} | {"a_field_of_a_later_version": 1}
    read = PurifyConfig.from_json(json.dumps(earlier))
    assert read.adv_estimator == AdvEstimator.GRPO and read.norm_adv_by_std and read.gamma == 0.3
    assert read.config_id == PurifyConfig(gamma=0.3).config_id


def test_the_aggregation_follows_the_loss_mode_and_its_constant_the_budget():
    assert TrainConfig().aggregation == "token-mean"
    assert TrainConfig(loss_mode=LossMode.GSPO).aggregation == "seq-mean-token-mean"  # verl's forced one
    assert TrainConfig(loss_mode="geo_mean").aggregation == "token-mean"
    assert TrainConfig(loss_mode="cispo", loss_agg_mode="seq-mean-token-sum").aggregation == "seq-mean-token-sum"
    assert TrainConfig(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean").aggregation == "seq-mean-token-mean"
    norm = TrainConfig(loss_agg_mode="seq-mean-token-sum-norm", max_response_tokens=2048)
    assert norm.scale_factor == 2048  # verl's default: the padded response length, the budget
    assert TrainConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=100).scale_factor == 100


def test_only_the_whole_batch_estimator_needs_the_whole_iteration():
    assert [PurifyConfig(adv_estimator=name).whole_batch for name in AdvEstimator] == [False, False, True]
