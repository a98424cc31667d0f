"""The policy as the train step uses it: a packed micro batch in, log-probs and entropy at its loss
tokens out (docs/architecture.md §7, "Memory at real shapes").

`TrainablePolicy` wraps the Hugging Face causal LM: its decoder gives the last hidden states of the
packed rows, and `logprobs.chunked_token_outputs` applies the lm_head only at the positions that
predict a loss token, a chunk at a time. Both engines train this module (DeepSpeed initialises
with it, so under ZeRO-3 the head's weight is gathered as a parameter of the module whose forward
reads it), and the KL reference is the same wrapper under no_grad. `load_models` is the one loader
of both.

Design decisions:
- Padding-free: with a flash-attention implementation (CUDA, flash-attn installed, bfloat16
  compute) the rows run as one sequence whose position ids restart at each row, which transformers
  turns into varlen attention that never crosses rows. Otherwise each row runs alone with causal
  attention, which neither pads nor materialises a T x T mask (SDPA's causal kernels keep memory
  linear in T on CPU and GPU).
- The head must be a plain linear layer on the last hidden state, as in Qwen, Llama and Mistral;
  a model whose logits are scaled or soft-capped after the head is refused with its name, rather
  than trained on log-probs that differ from its own.
- bfloat16 compute is autocast over float32 weights (the optimiser's master weights and moments
  stay float32); under DeepSpeed's bf16 mode the weights are already bfloat16 and autocast changes
  nothing. The log-softmax is float32 either way.
- Gradient checkpointing is non-reentrant, enabled for the training and switched off after it, so
  a model the torch backend also generates with is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.logprobs import TokenOutputs, chunked_token_outputs
from cleaner.engine.train.packing import PackedBatch
from cleaner.errors import CleanerError

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Config attributes of models whose logits are not just lm_head(last hidden state).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")


class UnsupportedModelError(CleanerError):
    """A policy whose logits the chunked head cannot reproduce."""


def check_plain_head(policy: torch.nn.Module) -> None:
    """UnsupportedModelError unless the policy's logits are a linear lm_head on its last hidden state."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"model type {config.model_type!r} sets {name} = {value}: its logits are not a plain "
                "linear lm_head on the last hidden state, which the chunked train step computes")
    if not isinstance(policy.get_output_embeddings(), torch.nn.Linear):
        raise UnsupportedModelError(f"model type {config.model_type!r}: its output embedding is not "
                                    "a torch.nn.Linear lm_head")


def uses_varlen_attention(policy: torch.nn.Module) -> bool:
    """Whether the policy's attention takes packed rows as varlen (flash attention)."""
    return "flash" in str(getattr(policy.config, "_attn_implementation", ""))


def attention_for(config: TrainConfig) -> str | None:
    """The attention implementation to load a training policy with: flash attention where it can
    run packed rows (CUDA, installed, bfloat16), else transformers' default."""
    if not (config.device.startswith("cuda") and config.compute_dtype == "bfloat16"):
        return None
    from transformers.utils import is_flash_attn_2_available  # transformers: CLI start-up time

    return "flash_attention_2" if is_flash_attn_2_available() else None


class TrainablePolicy(torch.nn.Module):
    """A causal LM that maps a PackedBatch to TokenOutputs at its loss tokens."""

    def __init__(self, policy: torch.nn.Module, config: TrainConfig, entropy_grad: bool = False):
        super().__init__()
        check_plain_head(policy)
        self.policy = policy
        self.chunk_tokens = config.logits_chunk_tokens
        self.compute_dtype = COMPUTE_DTYPES[config.compute_dtype]
        self.entropy_grad = entropy_grad

    def forward(self, batch: PackedBatch) -> TokenOutputs:
        with torch.autocast(batch.token_ids.device.type, dtype=self.compute_dtype,
                            enabled=self.compute_dtype != torch.float32):
            hidden = self.hidden_states(batch)  # (N, H)
        predictors = hidden.index_select(0, batch.predictor_index)  # (M, H)
        # read after the decoder: under ZeRO-3 a tied head weight is the embedding's, which the
        # decoder gathers and releases; read here, it is gathered for (and released after) this forward
        head = self.policy.get_output_embeddings()
        return chunked_token_outputs(predictors, head.weight, head.bias, batch.target_ids,
                                     self.chunk_tokens, self.compute_dtype, self.entropy_grad)

    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """The decoder's last hidden states (after its final norm) of the packed rows; (N, H)."""
        decoder = self.policy.get_decoder()
        if uses_varlen_attention(self.policy):
            out = decoder(input_ids=batch.token_ids[None], position_ids=batch.position_ids[None],
                          use_cache=False)
            return out.last_hidden_state[0]
        rows = batch.token_ids.split(list(batch.row_lengths))
        return torch.cat([decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0] for ids in rows])


@dataclass(frozen=True)
class Models:
    policy: TrainablePolicy  # trained
    reference: TrainablePolicy | None  # the frozen KL reference; None when kl_coef is 0


def load_models(policy_path: str | Path, config: TrainConfig, *, policy_device: str | torch.device,
                reference_device: str | torch.device, model: torch.nn.Module | None = None) -> Models:
    """The policy to train (`model` if given, else loaded from `policy_path`) and, when kl_coef > 0,
    the frozen reference: the policy at `policy_path`, loaded once for the iteration."""
    attention = attention_for(config)
    if model is None:
        model = load_policy(policy_path, policy_device, attn_implementation=attention)
    else:
        model = model.to(policy_device)
    reference = None
    if config.kl_coef > 0:
        frozen = load_policy(policy_path, reference_device, attn_implementation=attention)
        reference = TrainablePolicy(frozen.eval().requires_grad_(False), config)
    return Models(TrainablePolicy(model, config, entropy_grad=config.entropy_coef > 0), reference)


@contextlib.contextmanager
def training(policy: TrainablePolicy, config: TrainConfig) -> Iterator[None]:
    """Train mode (and gradient checkpointing, if configured) for the block; eval mode after it."""
    model = policy.policy
    policy.train()
    if config.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers < 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        if config.gradient_checkpointing:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
            model.disable_input_require_grads()  # the hook enable adds breaks inference-mode generation
        policy.eval()
