"""The output head a chunk of positions at a time, and the models whose log-probs it reproduces
(docs/architecture.md §6, §7).

Scoring and training need log pi(target) at some positions, never the positions x vocabulary
logits at once: at Qwen's 151,936-token vocabulary 32,768 positions are 18.5 GiB of float32
logits. Both take the decoder's last hidden states and apply the lm_head `chunk_tokens` positions
at a time (purify's scorer through `target_logprobs`, without a gradient; the train step through
logprobs.py's autograd function), so their peak is one chunk's logits whatever the positions.

Design decisions:
- The matmul runs in the given dtype (bfloat16 under --compute-dtype bfloat16), the log-softmax in
  float32, as verl and Liger do.
- Only a plain linear head on the last hidden state is reproduced: a model whose config scales or
  soft-caps its logits after the head is refused with the field's name (`check_plain_head`).
- Attention that a packed or trie forward does not run is refused by name (`check_attention`): a
  sliding window that a row outgrows (within the window, sliding attention is causal attention) and
  attention sinks (learned per-head logits, gpt-oss), rather than scored or trained on log-probs
  that differ from the model's own.
"""

from __future__ import annotations

import torch

from cleaner.errors import CleanerError

DEFAULT_CHUNK_TOKENS = 512  # tokens per lm_head chunk: 512 x 151,936 x 4 B = 0.31 GB a copy
# Config attributes of models whose logits are not just lm_head(last hidden state).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale",
                    "dim_model_base")


class UnsupportedModelError(CleanerError):
    """A model whose log-probs the chunked head or the packed attention cannot reproduce."""


def text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_plain_head(model: torch.nn.Module) -> None:
    """UnsupportedModelError unless the model's logits are a linear lm_head on its last hidden state."""
    config = text_config(model)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"model type {config.model_type!r} sets {name} = {value}: its logits are not a plain "
                "linear lm_head on the last hidden state, which the chunked head computes")
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise UnsupportedModelError(f"model type {config.model_type!r}: its output embedding is not "
                                    "a torch.nn.Linear lm_head")


def sliding_window(model: torch.nn.Module) -> tuple[str, int] | None:
    """(the config field that turns it on, the window) if some layer attends over a sliding window."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2/3, Gemma 2/3, ...: per layer
        return ("layer_types", int(window)) if "sliding_attention" in layer_types else None
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2-style flag, off
        return None
    return ("sliding_window", int(window))  # Mistral v0.1-style: on whenever set


def has_attention_sinks(model: torch.nn.Module) -> bool:
    """Whether an attention layer carries learned sink logits (gpt-oss's `sinks`)."""
    return any(name.endswith(".sinks") or name == "sinks" for name, _ in model.named_parameters())


def check_attention(model: torch.nn.Module, longest_row: int | None = None) -> None:
    """UnsupportedModelError, naming the config, if the packed forward would not compute the model's
    own attention: sinks always, a sliding window once a row is longer than it."""
    config = text_config(model)
    if has_attention_sinks(model):
        raise UnsupportedModelError(f"model type {config.model_type!r} has attention sinks (learned per-head "
                                    "logits), which the packed attention does not compute")
    found = sliding_window(model)
    if found is not None and longest_row is not None and longest_row > found[1]:
        field, window = found
        raise UnsupportedModelError(
            f"model type {config.model_type!r} attends over a sliding window of {window} tokens (config "
            f"{field}{'' if field == 'sliding_window' else ', sliding_window'}), and a row here is {longest_row:,} "
            f"tokens: the packed attention computes full causal attention, which equals the model's only "
            f"within its window; shorten the rows below {window} tokens or use a full-attention model")


# ---------------------------------------------------------------------------- the head, a chunk at a time


def head_in(dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None):
    """The head's weight and bias in the compute dtype, cast once per pass (no copy if they are)."""
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """The head on one chunk: (C, H) -> (C, V) float32, the matmul in `dtype` (weight and bias
    already in it)."""
    logits = hidden.to(dtype) @ weight.t()  # (C, V)
    if bias is not None:
        logits = logits + bias
    return logits.float()


@torch.no_grad()
def target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log pi(targets) from the hidden states that predict them, one chunk of logits at a time.
    hidden (M, H), targets (M,) -> (M,) float32."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    head_weight, head_bias = head_in(dtype, weight, bias)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        logits = chunk_logits(hidden[rows], head_weight, head_bias, dtype)  # (C, V)
        out[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return out
