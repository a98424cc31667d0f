"""Key/value cache plumbing shared by the torch backend and the prefix-trie scorer.

Design decisions:
- A KV cache crosses function boundaries as a plain tuple of per-layer `(keys, values)` tensors of
  shape (B, H, T, D), not as a transformers `Cache` object. The tuple is immutable, so selecting
  rows of a batch never mutates a cache that another branch of the trie still needs. A fresh
  `DynamicCache` is built for every forward (`DynamicLayer.update` concatenates, so the old
  tensors are never written to).
- The scorer instead hands a forward a `BufferCache`: one fresh (layers, 2, B, H, P + W, D) buffer
  whose first P positions it has filled with the prefixes; each layer writes its W new positions
  in place. That saves DynamicCache's two copies of the prefix per forward (its constructor
  concatenates onto an empty tensor, its update onto the prefix), and after the forward the
  buffer holds every row's whole path, so a child's cache is a view of it. The buffer is never
  written again once its forward returns.
- Every forward passes an explicit attention mask and explicit position ids: a 2-D mask (the
  backend), with which transformers never guesses "packed sequences" from the position ids, or a
  ready 4-D one (the scorer), which transformers passes through as it is. Left or right padding is
  handled by the mask alone.
- Log-probs are `gather(logits) - logsumexp(logits)` in float32: only the (B, T) targets and, where
  asked, the last position's (B, V) distribution are kept, never a (B, T, V) log-softmax copy.
- Only full-attention layers are supported (Qwen3, Llama, Mistral without sliding window): the
  cache keeps every position, so a sliding-window model would get a correct mask but no memory win.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer: keys, values, each (B, H, T, D)


# ---------------------------------------------------------------------------- cache conversion


def kv_from_cache(cache: DynamicCache) -> KV:
    """Per-layer (keys, values) of a transformers cache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    return tuple(zip(cache.key_cache, cache.value_cache, strict=True))  # older transformers


def kv_to_cache(kv: KV | None) -> DynamicCache | None:
    """A fresh DynamicCache holding `kv` (None stays None)."""
    if kv is None:
        return None
    return DynamicCache(ddp_cache_data=kv)


class _BufferLayer(DynamicLayer):
    """One layer of a BufferCache: keys and values are views of the shared buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.keys, self.values, self.length = keys, values, length  # (B, H, T_max, D), filled up to length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise ValueError(f"BufferCache holds {self.keys.shape[-2]} positions, a forward asked for {end}")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length


class BufferCache(DynamicCache):
    """A cache over a preallocated (layers, 2, B, H, T_max, D) buffer whose first `length` positions
    are filled; forwards write the new positions in place (see the module docstring)."""

    def __init__(self, buffer: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buffer = buffer
        self.layers = [_BufferLayer(buffer[layer, 0], buffer[layer, 1], length) for layer in range(buffer.shape[0])]
        self.layer_class_to_replicate = None


def kv_select(kv: KV, rows: torch.Tensor | slice) -> KV:
    """Keep the batch rows `rows` (an index tensor or a slice)."""
    return tuple((keys[rows], values[rows]) for keys, values in kv)


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
    past: KV | BufferCache | None = None,
    logits_to_keep: int = 0,  # 0 = logits at every position, k = only the last k
) -> ForwardOutput:
    """One forward of a Hugging Face causal LM on top of an optional cache."""
    out = _call_with_cache(model, input_ids, attention_mask, position_ids, past, logits_to_keep=logits_to_keep)
    return ForwardOutput(logits=out.logits, kv=kv_from_cache(out.past_key_values))


@dataclass(frozen=True)
class HiddenOutput:
    hidden: torch.Tensor  # (B, T, H) final hidden states, after the decoder's last norm
    kv: KV  # cache covering past + the new positions


def hidden_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor,  # (B, T_past + T), 1 = real token
    position_ids: torch.Tensor,  # (B, T)
    past: KV | BufferCache | None = None,
) -> HiddenOutput:
    """The decoder body only: the caller applies the output head to the positions it needs."""
    out = _call_with_cache(model.get_decoder(), input_ids, attention_mask, position_ids, past)
    return HiddenOutput(hidden=out.last_hidden_state, kv=kv_from_cache(out.past_key_values))


def _call_with_cache(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, past: KV | BufferCache | None, **extra):
    """Call a transformers model or decoder with explicit mask and positions, on a fresh cache."""
    return module(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past if isinstance(past, BufferCache) else kv_to_cache(past),
        use_cache=True,
        **extra,
    )


@torch.inference_mode()
def head_is_plain_linear(model: torch.nn.Module) -> bool:
    """True when logits == output_embeddings(decoder hidden states), checked on a short probe.

    False for heads that scale or soft-cap the logits after the projection (Gemma 2, Cohere);
    callers then fall back to full forwards.
    """
    try:
        head, decoder = model.get_output_embeddings(), model.get_decoder()
    except (AttributeError, NotImplementedError):
        return False
    if head is None or decoder is None:
        return False
    device = next(model.parameters()).device
    probe = torch.arange(4, device=device).unsqueeze(0) % model.config.vocab_size  # (1, 4)
    full = model(input_ids=probe).logits.float()
    split = head(decoder(input_ids=probe).last_hidden_state).float()
    return full.shape == split.shape and torch.allclose(full, split, atol=1e-4, rtol=1e-3)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] without materialising the full log-softmax.

    logits (B, T, V), targets (B, T) -> (B, T) float32.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)
