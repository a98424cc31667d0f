"""The DeepSpeed config of a run: the user's file for DeepSpeed's own settings, cleaner's for the rest.

Both engines must train the same thing (docs/architecture.md §7), so what defines the training
comes from TrainConfig alone, whichever engine runs it:
- batch sizes: `train_micro_batch_size_per_gpu` = micro_batch_size, `gradient_accumulation_steps`
  = ceil(mini_batch_size / (micro_batch_size x ranks)), `train_batch_size` their product with the
  ranks (a short share of a mini batch is padded with zero-weight micro batches, `deepspeed_engine`);
- the optimiser, its learning rate and warmup: cleaner's one AdamW and transformers' constant
  schedule with warmup (`optim.py`), handed to DeepSpeed as a client optimiser and scheduler;
- clipping: `gradient_clipping` = max_grad_norm;
- precision: `bf16.enabled` = (compute_dtype == "bfloat16"), `fp16.enabled` = (compute_dtype ==
  "float16", with dynamic loss scaling: `loss_scale` 0): 16-bit weights and compute with float32
  master weights and optimiser state in DeepSpeed's optimiser wrapper, the counterpart of the
  torch engine's autocast (and its GradScaler, for float16). The fp16 section's other settings
  (initial_scale_power, loss_scale_window, hysteresis, min_loss_scale) are the file's; so is a
  static `loss_scale`, kept with a warning line since it is not the dynamic scaling the docs and
  the torch engine use.

The file carries what is DeepSpeed's own: the ZeRO stage, offloading, bf16's other settings,
communication and logging settings. A file that sets one of cleaner's keys is an error naming the
key and the cleaner option to use instead, not a warning: a value silently overridden would let
the file say one thing while the run does another. The value "auto" (Hugging Face's convention)
is accepted for those keys and means "cleaner sets it".

cleaner also sets what its engine needs:
- ZeRO-3 gathers the 16-bit weights on save (`stage3_gather_16bit_weights_on_model_save`), since
  the checkpoint is a plain Hugging Face directory; a file that turns it off is an error.
- With the optimiser offloaded (`zero_optimization.offload_optimizer`), DeepSpeed steps cleaner's
  torch AdamW on the CPU partitions (`zero_force_ds_cpu_optimizer: false`): slower than
  DeepSpeedCPUAdam, but the same optimiser and state as the torch engine's.

This module imports nothing of DeepSpeed's, so the rules are testable without it installed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

from cleaner.config import TrainConfig
from cleaner.errors import CleanerError

logger = logging.getLogger(__name__)

AUTO = "auto"
# Keys cleaner sets from TrainConfig, with the options that set them.
CLEANER_KEYS = {
    "train_batch_size": "--mini-batch-size",
    "train_micro_batch_size_per_gpu": "--micro-batch-size",
    "gradient_accumulation_steps": "--mini-batch-size and --micro-batch-size",
    "gradient_clipping": "max_grad_norm",
    "optimizer": "--lr and --weight-decay (cleaner's AdamW)",
    "scheduler": "--warmup-steps (cleaner's constant schedule with warmup)",
}
# The current name of ZeRO-3's gather-on-save switch and the aliases DeepSpeed also reads.
GATHER_KEYS = (
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)


class DeepSpeedConfigError(CleanerError):
    """The DeepSpeed config file or installation cannot run cleaner's training."""


def require_deepspeed() -> None:
    """Fail with the install command when deepspeed is not importable."""
    if importlib.util.find_spec("deepspeed") is None:
        raise DeepSpeedConfigError(
            "engine deepspeed needs DeepSpeed: pip install 'cleaner[deepspeed]'")


def check_deepspeed_setup(config: TrainConfig) -> None:
    """Fail before any work when the config file is unusable or DeepSpeed is missing."""
    read_deepspeed_config(config.deepspeed_config)
    require_deepspeed()


def read_deepspeed_config(path: str | Path) -> dict:
    """The user's DeepSpeed JSON, checked: an object that sets none of cleaner's keys."""
    try:
        ds_config = json.loads(Path(path).read_text())
    except OSError as error:
        raise DeepSpeedConfigError(f"{path}: cannot read the DeepSpeed config ({error})") from error
    except json.JSONDecodeError as error:
        raise DeepSpeedConfigError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(ds_config, dict):
        raise DeepSpeedConfigError(f"{path}: a DeepSpeed config is a JSON object, got {type(ds_config).__name__}")
    for key, option in CLEANER_KEYS.items():
        if key in ds_config and ds_config[key] != AUTO:
            raise DeepSpeedConfigError(
                f"{path}: {key!r} is cleaner's to set, from {option}, so that both engines train the "
                f"same thing; remove it from the DeepSpeed config (or set it to \"auto\")")
    zero = ds_config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise DeepSpeedConfigError(f"{path}: 'zero_optimization' must be a JSON object")
    _check_precision(path, ds_config)
    for key in GATHER_KEYS:
        if zero.get(key) is False and int(zero.get("stage", 0)) == 3:
            raise DeepSpeedConfigError(
                f"{path}: zero_optimization.{key} is false, but a ZeRO-3 checkpoint is a Hugging Face "
                "directory of gathered weights; remove the key (cleaner sets it to true)")
    if zero.get("offload_optimizer") and ds_config.get("zero_force_ds_cpu_optimizer") is True:
        raise DeepSpeedConfigError(
            f"{path}: zero_force_ds_cpu_optimizer is true, but cleaner's optimiser is torch AdamW "
            "(the torch engine's); remove the key")
    return ds_config


def _check_precision(path: str | Path, ds_config: dict) -> None:
    """bf16.enabled and fp16.enabled are cleaner's (from --compute-dtype)."""
    for section in ("bf16", "fp16"):
        if not isinstance(ds_config.get(section, {}), dict):
            raise DeepSpeedConfigError(f"{path}: {section!r} must be a JSON object")
        if ds_config.get(section, {}).get("enabled", AUTO) != AUTO:
            dtype = "bfloat16" if section == "bf16" else "float16"
            raise DeepSpeedConfigError(
                f"{path}: {section}.enabled is cleaner's to set, from --compute-dtype ({dtype} enables it), so "
                "that both engines compute in the same precision; remove it (or set it to \"auto\")")


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (0 when ZeRO is off)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def deepspeed_config_for(config: TrainConfig, world_size: int, device_type: str = "cuda") -> dict:
    """The DeepSpeed config to initialise with: the user's file plus what cleaner sets, for ranks
    on devices of `device_type` (whose compute dtype `auto` resolves to)."""
    ds_config = read_deepspeed_config(config.deepspeed_config)
    for key in CLEANER_KEYS:
        ds_config.pop(key, None)  # only "auto" can be left here
    accumulation = math.ceil(config.mini_batch_size / (config.micro_batch_size * world_size))
    ds_config["train_micro_batch_size_per_gpu"] = config.micro_batch_size
    ds_config["gradient_accumulation_steps"] = accumulation
    ds_config["train_batch_size"] = config.micro_batch_size * accumulation * world_size
    ds_config["gradient_clipping"] = config.max_grad_norm
    dtype = config.compute_dtype_on(device_type)
    ds_config["bf16"] = {**ds_config.get("bf16", {}), "enabled": dtype == "bfloat16"}
    fp16 = {**ds_config.get("fp16", {}), "enabled": dtype == "float16"}
    if dtype == "float16":
        fp16.setdefault("loss_scale", 0)  # dynamic loss scaling, as the torch engine's GradScaler
        if fp16["loss_scale"] != 0:
            logger.warning("%s: fp16.loss_scale %s is a static loss scale: the run keeps it, not the dynamic "
                           "scaling the torch engine uses (remove it, or set 0, for dynamic)",
                           config.deepspeed_config, fp16["loss_scale"])
    ds_config["fp16"] = fp16
    zero = dict(ds_config.get("zero_optimization", {}))
    if int(zero.get("stage", 0)) == 3:
        for key in GATHER_KEYS:
            zero.pop(key, None)
        zero[GATHER_KEYS[0]] = True
    if zero:
        ds_config["zero_optimization"] = zero
    if zero.get("offload_optimizer"):
        ds_config["zero_force_ds_cpu_optimizer"] = False
    return ds_config
