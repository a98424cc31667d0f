"""LoRA adapters (peft), named as verl names them (docs/architecture.md §7; docs/running.md, "LoRA").

`lora_rank` r > 0 trains rank-r adapters on the linear layers `lora_target_modules` names (module
names, matched as peft matches them: the name or its last dotted parts; or `all-linear`, every linear
layer but the lm_head), scaled by `lora_alpha` / r, and nothing else: the optimiser holds only the
adapters, so the base has no gradients and no moments.

Design decisions:
- peft's LoraConfig as verl's actor builds its own: no dropout, no bias terms. The adapters start
  as peft starts them (A Kaiming-uniform, B zero), drawn from the train seed alone, so both engines
  and every rank start from the same adapters.
- Targets are checked against the model before any work: each name must match linear layers of the
  decoder and nothing else. The lm_head is refused: the chunked head (train/logprobs.py) reads its
  weight itself, so an adapter there would never be applied.
- The KL reference is the same module with its adapters disabled (peft's `disable_adapter`, as verl
  computes it): one copy of the base weights. Its log-probs are taken in each micro batch, before
  the policy's forward (`AdapterReference`), so under ZeRO-3 every rank runs the same forwards.
  Without LoRA the reference is the iteration's input checkpoint; with LoRA it is the base the
  adapters were first put on, in every iteration.
- A checkpoint's root holds the merged weights W + (alpha / r) B A in the usual Hugging Face layout,
  which every backend reloads (computed out of place, a layer at a time, so the base stays as it was
  bit for bit), and `adapter/` the adapter in peft's layout (`PeftModel.from_pretrained`), its
  adapter_config.json naming the base (an absolute path, or a hub id). Not at the root: there, an
  adapter_config.json makes AutoModelForCausalLM apply the adapter again over the merged weights.
- A LoRA checkpoint continues on its base: the next iteration, `--resume` and `train --policy CKPT`
  load the base and the adapter (and the adapters' optimiser state), never the merged weights, so two
  iterations train what one continuous run trains. Its rank, alpha and layers must be the config's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cleaner.config import TrainConfig
from cleaner.config.settings import LORA_ALL_LINEAR
from cleaner.engine.model.loading import check_model_path, load_policy
from cleaner.engine.train.checkpoint import save_pretrained_as
from cleaner.errors import CleanerError
from cleaner.plugins import resolved_path

ADAPTER_DIR = "adapter"  # inside a checkpoint: the adapter in peft's layout
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # a PeftModel's state-dict names of its base's tensors


class LoraError(CleanerError, ValueError):
    """LoRA settings that do not fit the model or the checkpoint; the message says what does."""


def require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise LoraError("--lora-rank needs peft, which is not installed here: pip install 'cleaner[lora]'")


def is_peft(model: torch.nn.Module) -> bool:
    """Whether `model` is a PeftModel (without importing peft where it is not)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


# ---------------------------------------------------------------------------
# Which layers get adapters


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of targets: the module's name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def targeted(model: torch.nn.Module, targets: str) -> dict[str, torch.nn.Linear]:
    """{module name: layer} of the linear layers `targets` (comma-separated names, or all-linear)
    gives adapters; LoraError naming each name that matches none, or matches the lm_head or a
    module that is not linear, with the model's linear layers listed."""
    head = model.get_output_embeddings()
    linear = {name: module for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and module is not head}
    kind = getattr(model.config, "model_type", type(model).__name__)
    if not linear:
        raise LoraError(f"model type {kind!r} has no linear layer besides its lm_head for LoRA adapters")
    if targets == LORA_ALL_LINEAR:
        return linear
    names = targets.split(",")
    missing = [target for target in names if not any(_matches(name, target) for name in _model_names(model))]
    faults = ([f"has no module {' or '.join(missing)}"] if missing else []) + [
        fault for fault in (_target_fault(model, linear, head, target) for target in names if target not in missing)
        if fault]
    if faults:
        found = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise LoraError(f"--lora-target-modules {targets}: model type {kind!r} {'; '.join(faults)}; its linear "
                        f"layers are {', '.join(found)} (or {LORA_ALL_LINEAR}: every one)")
    return {name: layer for name, layer in linear.items() if any(_matches(name, target) for target in names)}


def _target_fault(model: torch.nn.Module, linear: dict, head: torch.nn.Module, target: str) -> str | None:
    """What is wrong with a target name the model has; None if it names linear layers only."""
    other = next(((name, module) for name, module in model.named_modules()
                  if name and name not in linear and _matches(name, target)), None)
    if other is not None and other[1] is head:
        return f"has {target} as its lm_head, whose weight the chunked head reads itself (no adapter there)"
    if other is not None:
        return f"has {target} as a {type(other[1]).__name__} ({other[0]}), not a linear layer"
    return None


def _model_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def adapter_parameters(model: torch.nn.Module, config: TrainConfig) -> int:
    """The parameters rank-r adapters add to `model` (a Hugging Face model, on the meta device or
    not; a PeftModel: its trainable ones): r x (inputs + outputs) per targeted layer."""
    if is_peft(model):
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    return sum(config.lora_rank * (layer.in_features + layer.out_features)
               for layer in targeted(model, config.lora_target_modules).values())


def meta_model(policy: str | Path) -> torch.nn.Module:
    """The policy's architecture on the meta device (its config.json; no weight is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # CLI start-up time

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(policy)))


# ---------------------------------------------------------------------------
# A checkpoint's adapter


@dataclass(frozen=True)
class SavedAdapter:
    """What a LoRA checkpoint's adapter/adapter_config.json says."""

    base: str  # the model the adapters were first put on: a path, or a hub id
    rank: int
    alpha: int
    targets: tuple[str, ...]  # peft's target_modules as saved (names, or every layer's full name)


def saved_adapter(policy: str | Path) -> SavedAdapter | None:
    """The adapter a checkpoint holds; None for any other model."""
    path = Path(policy) / ADAPTER_DIR / ADAPTER_CONFIG
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    targets = saved["target_modules"]
    return SavedAdapter(saved["base_model_name_or_path"], int(saved["r"]), int(saved["lora_alpha"]),
                        (targets,) if isinstance(targets, str) else tuple(targets))


def new_adapters(policy: str | Path, config: TrainConfig) -> bool:
    """Whether LoRA training from `policy` starts new adapters (and a fresh optimiser for them):
    with a rank, on anything but a LoRA checkpoint."""
    return config.lora_rank > 0 and saved_adapter(policy) is None


def check_setup(policy: str | Path, config: TrainConfig, model: torch.nn.Module | None = None) -> None:
    """LoraError before any work when the LoRA settings cannot train `policy` (module notes): peft
    missing, targets the model lacks, a LoRA checkpoint trained without a rank or with other
    adapters, or one whose base is gone. `model`: the policy in memory, if it is."""
    if config.lora_rank > 0:
        require_peft()
    if model is not None and is_peft(model):
        return  # adapted already, under these settings
    saved = saved_adapter(policy)
    if config.lora_rank == 0 and saved is None:
        return
    structure = model if model is not None else meta_model(policy)
    if saved is None:
        targeted(structure, config.lora_target_modules)
        return
    trained = set(targeted(structure, ",".join(saved.targets)))
    flags = f"--lora-rank {saved.rank} --lora-alpha {saved.alpha} --lora-target-modules {_spelled(trained, structure)}"
    if config.lora_rank == 0:
        raise LoraError(f"{policy}: a LoRA checkpoint (rank {saved.rank} adapters on {saved.base}): continue it with "
                        f"{flags}, or train its merged weights from a copy without its adapter/ and optimizer/ "
                        "directories")
    layers = set(targeted(structure, config.lora_target_modules))
    if (saved.rank, saved.alpha) != (config.lora_rank, config.lora_alpha) or trained != layers:
        raise LoraError(f"{policy}: its adapters (rank {saved.rank}, alpha {saved.alpha}, on {len(trained)} layers) "
                        f"are not the ones these settings train (rank {config.lora_rank}, alpha {config.lora_alpha}, "
                        f"on {len(layers)}); continue them with {flags}")
    try:
        check_model_path(saved.base)
    except CleanerError as error:
        raise LoraError(f"{policy}: its adapters continue on their base {saved.base} ({ADAPTER_DIR}/{ADAPTER_CONFIG}"
                        f"'s base_model_name_or_path), which cannot be loaded: {error}") from error


def _spelled(layers: set[str], model: torch.nn.Module) -> str:
    """`--lora-target-modules` for these layers: all-linear, their last names, or their full names."""
    if layers == set(targeted(model, LORA_ALL_LINEAR)):
        return LORA_ALL_LINEAR
    short = ",".join(sorted({name.rsplit(".", 1)[-1] for name in layers}))
    return short if set(targeted(model, short)) == layers else ",".join(sorted(layers))


# ---------------------------------------------------------------------------
# Putting adapters on, loading them, the reference


def with_adapters(model: torch.nn.Module, config: TrainConfig, base: str) -> torch.nn.Module:
    """`model` (a Hugging Face causal LM, adapted in place) as a PeftModel with new adapters,
    drawn from the seed alone; its adapter config names `base`."""
    from peft import LoraConfig, get_peft_model  # optional extra (lora): only with --lora-rank

    targets = config.lora_target_modules
    targeted(model, targets)  # the settings' layers, on the model itself
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=targets if targets == LORA_ALL_LINEAR else targets.split(","),
                      task_type="CAUSAL_LM")
    with torch.random.fork_rng():  # the adapters' draw depends on the seed, not on what ran before
        torch.manual_seed(config.seed)
        adapted = get_peft_model(model, lora)
    adapted.peft_config[ADAPTER_NAME].base_model_name_or_path = base
    return adapted


def load_with_adapters(policy: str | Path, config: TrainConfig, device: str | torch.device,
                       model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The PeftModel to train from `policy`, in float32 on `device`: `model` itself if it is one
    (the run's, trained last iteration); a LoRA checkpoint's base with its adapter (trainable); or
    `policy` (`model`, if given, is it in memory) with new adapters."""
    if model is not None and is_peft(model):
        return model.to(device)
    saved = saved_adapter(policy)
    if saved is None:
        base = model.to(device) if model is not None else load_policy(policy, device)
        return with_adapters(base, config, str(resolved_path(str(policy), always=False)))
    if model is not None:  # the merged weights are not the adapters' base
        raise ValueError(f"{policy} is a LoRA checkpoint: train it from its base and adapter, not its merged weights")
    from peft import PeftModel  # optional extra (lora): only with --lora-rank

    return PeftModel.from_pretrained(load_policy(saved.base, device), Path(policy) / ADAPTER_DIR, is_trainable=True)


class AdapterReference:
    """The KL reference of a LoRA run (module notes): `run` (the TrainablePolicy `policy`, or a
    DeepSpeed engine over it) forwards each micro batch with the adapters disabled, without grad."""

    def __init__(self, run: Callable, policy: torch.nn.Module) -> None:
        self.run, self.policy = run, policy

    def log_probs(self, rows: Sequence, batch) -> torch.Tensor:
        """log pi_base at the batch's loss tokens. (M,)"""
        with torch.no_grad(), reference_mode(self.policy):
            return self.run(batch).log_probs.detach().float()


@contextlib.contextmanager
def reference_mode(policy: torch.nn.Module) -> Iterator[None]:
    """A TrainablePolicy over a PeftModel as the base for the block: adapters off, no entropy."""
    entropy, entropy_grad = policy.entropy, policy.entropy_grad
    policy.entropy = policy.entropy_grad = False
    try:
        with policy.policy.disable_adapter():
            yield
    finally:
        policy.entropy, policy.entropy_grad = entropy, entropy_grad


# ---------------------------------------------------------------------------
# Saving: the merged weights and the adapter


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PeftModel's state dict as its base's, Hugging Face names: each adapted layer's weight
    W + scaling x B A, computed in float32 a layer at a time and kept on the host in W's dtype; the
    other tensors as they are (shared ones stay shared); the adapters left out."""
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        name = key.removeprefix(PEFT_PREFIX)
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            layer = key.removesuffix(".base_layer.weight")
            a = state_dict[f"{layer}.lora_A.{ADAPTER_NAME}.weight"].float()  # (r, in)
            b = state_dict[f"{layer}.lora_B.{ADAPTER_NAME}.weight"].float()  # (out, r)
            tensor = (tensor.float() + scaling * (b @ a)).to("cpu", tensor.dtype)  # (out, in)
        merged[name.replace(".base_layer.", ".")] = tensor
    return merged


def save_with_adapters(model: torch.nn.Module, directory: Path, save_dtype: str,
                       state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """A PeftModel (or `state_dict`, its state gathered from ZeRO-3's partitions) saved as a LoRA
    checkpoint: the merged weights at `directory` in `save_dtype`, the adapter in adapter/."""
    state = state_dict if state_dict is not None else model.state_dict()
    lora = model.peft_config[ADAPTER_NAME]
    save_pretrained_as(model.get_base_model(), directory, save_dtype, merged_state_dict(state, lora.lora_alpha / lora.r))
    model.save_pretrained(directory / ADAPTER_DIR, state_dict=state_dict, save_embedding_layers=False)
