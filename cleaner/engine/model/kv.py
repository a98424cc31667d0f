"""Key/value cache plumbing of the torch backend, and the cache-geometry probe of the prefix-trie scorer.

Design decisions:
- A KV cache crosses function boundaries as a plain tuple of per-layer `(keys, values)` tensors of
  shape (B, H, T, D), not as a transformers `Cache` object. The tuple is immutable, so selecting
  rows of a batch never mutates a cache that something else still holds. A fresh
  `DynamicCache` is built for every forward (`DynamicLayer.update` concatenates, so the old
  tensors are never written to).
- The prefix-trie scorer keeps its caches in its own buffers and runs attention itself
  (trie_scorer.py); from here it takes only `kv_geometry`.
- Every forward passes an explicit 2-D attention mask and explicit position ids, so transformers
  never guesses "packed sequences" from the position ids; left or right padding is handled by the
  mask alone.
- Log-probs are `gather(logits) - logsumexp(logits)` in float32: only the (B, T) targets and, where
  asked, the last position's (B, V) distribution are kept, never a (B, T, V) log-softmax copy.
- Only full-attention layers are supported (Qwen3, Llama, Mistral without sliding window): the
  cache keeps every position, so a sliding-window model would get a correct mask but no memory win.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer: keys, values, each (B, H, T, D)


# ---------------------------------------------------------------------------- cache conversion


def kv_from_cache(cache: DynamicCache) -> KV:
    """Per-layer (keys, values) of a transformers cache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    return tuple(zip(cache.key_cache, cache.value_cache, strict=True))  # older transformers


@functools.cache
def _cache_argument_of(forward_type: type, parameters: tuple[str, ...]) -> str:
    if "cache" in parameters or "past_key_values" in parameters:
        return "cache" if "cache" in parameters else "past_key_values"
    from transformers.modeling_outputs import CausalLMOutputWithPast  # what this version names it

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(model: torch.nn.Module) -> str:
    """The name a model's forward takes its cache by: `cache` since transformers 5.2x renamed
    `past_key_values` (which it still takes, with a FutureWarning on every forward)."""
    return _cache_argument_of(type(model), tuple(inspect.signature(model.forward).parameters))


def output_cache(output) -> DynamicCache:
    """The cache a forward returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def kv_to_cache(kv: KV | None) -> DynamicCache | None:
    """A fresh DynamicCache holding `kv` (None stays None)."""
    if kv is None:
        return None
    return DynamicCache(ddp_cache_data=kv)


# ---------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # (B, T_kept, V) in the model's dtype
    kv: KV  # cache covering past + the new positions


def causal_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor,  # (B, T_past + T), 1 = real token
    position_ids: torch.Tensor,  # (B, T)
    past: KV | None = None,
    logits_to_keep: int = 0,  # 0 = logits at every position, k = only the last k
) -> ForwardOutput:
    """One forward of a Hugging Face causal LM on top of an optional cache (a fresh DynamicCache)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **{cache_argument(model): kv_to_cache(past)},
    )
    return ForwardOutput(logits=out.logits, kv=kv_from_cache(output_cache(out)))


@torch.inference_mode()
def kv_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of the model's cache, read off a one-token probe."""
    device = next(model.parameters()).device
    kv = kv_from_cache(model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
                       .past_key_values)
    keys = kv[0][0]  # (1, H_kv, 1, D)
    return len(kv), keys.shape[1], keys.shape[-1]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] without materialising the full log-softmax.

    logits (B, T, V), targets (B, T) -> (B, T) float32.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)
