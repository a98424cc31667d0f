"""The policy as the train step uses it: a packed micro batch in, log-probs and entropy at its loss
tokens out (docs/architecture.md §7, "Memory at real shapes").

`TrainablePolicy` wraps the Hugging Face causal LM: its decoder gives the last hidden states of the
packed rows, and `logprobs.chunked_token_outputs` applies the lm_head only at the positions that
predict a loss token, a chunk at a time. Both engines train this module (DeepSpeed initialises
with it, so under ZeRO-3 the head's weight is gathered as a parameter of the module whose forward
reads it), and the KL reference is the same wrapper under no_grad, loaded in the compute dtype
(`load_reference`) for the one pass that computes its log-probs (step.ReferenceLogProbs); with
LoRA it is this very module with its adapters disabled (lora.py).

Design decisions:
- Padding-free, one decoder call per micro batch: the rows run as one sequence whose position ids
  restart at each row, with the rows' bounds (`cu_seq_lens`) passed to attention. With flash-attn
  on CUDA and bfloat16 compute that is flash attention's varlen kernel; otherwise
  `packed_sdpa_attention`, registered with transformers' AttentionInterface, runs causal SDPA
  inside each row's span: no padding, and no T x T mask. On a GPU only the fused kernels may run
  (flash, memory-efficient, cuDNN: `fused_causal_attention`), in any dtype, with grouped K/V copied
  per query head, since float32 with grouped heads fell to the math kernel's T x T scores (68 GB at
  16,384 tokens on an H100); no fused kernel is one line, not a fall back.
  One call per micro batch also keeps ZeRO-3's per-layer gathers in step across ranks. The packed
  implementation is on for the training (checkpointing recomputes layers in backward) and for each
  forward outside it, and the model's own is restored after, so a model the torch backend
  generates with is left as it was.
- The head must be a plain linear layer on the last hidden state, as in Qwen, Llama and Mistral;
  a model whose logits are scaled or soft-capped after the head is refused with its name, rather
  than trained on log-probs that differ from its own.
- bfloat16 compute is autocast over float32 weights (the optimiser's master weights and moments
  stay float32); under DeepSpeed's bf16 mode the weights are already bfloat16 and autocast changes
  nothing. The log-softmax is float32 either way.
- Gradient checkpointing is non-reentrant, enabled for the training and switched off after it
  (reentrant under ZeRO-3 with LoRA, where DeepSpeed 0.19.0 partitions the frozen weights a
  non-reentrant recomputation still holds: deepspeed_engine.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from cleaner.config import TrainConfig
from cleaner.engine.model.head import UnsupportedModelError, check_attention, check_plain_head
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.logprobs import TokenOutputs, chunked_token_outputs
from cleaner.engine.train.lora import load_with_adapters
from cleaner.engine.train.packing import PackedBatch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACKED_ATTENTION = "cleaner_packed_sdpa"  # the name packed_sdpa_attention is registered under
FLASH_ATTENTION = "flash_attention_2"


# ---------------------------------------------------------------------------
# Packed attention


def packed_sdpa_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, row_bounds=None,
                          sliding_window=None, s_aux=None, **kwargs):
    """Causal SDPA within each packed row; query (1, heads, N, D), key and value (1, kv heads, N, D)
    -> (1, N, heads, D), as transformers' attention functions return. `row_bounds` are the rows'
    bounds on the host (the micro batch's, passed down by `hidden_states`), so no call reads them
    back from the device; a layer's sliding window must hold every row, and sinks are refused."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # CLI start-up time

    if row_bounds is None:
        if cu_seq_lens_q is None:
            raise RuntimeError(f"{PACKED_ATTENTION} runs packed rows only: the call passed no row bounds")
        row_bounds = tuple(cu_seq_lens_q.tolist())
    if s_aux is not None:
        raise UnsupportedModelError("the packed attention does not compute attention sinks")
    longest = max(end - start for start, end in zip(row_bounds, row_bounds[1:], strict=False))
    if sliding_window is not None and longest > sliding_window:
        raise UnsupportedModelError(f"a packed row of {longest:,} tokens is longer than the layer's sliding window "
                                    f"of {sliding_window}, which the packed attention does not apply")
    if query.is_cuda:
        spans = [fused_causal_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                        kwargs.get("scaling"), kwargs.get("dropout", 0.0))
                 for start, end in zip(row_bounds, row_bounds[1:], strict=False)]
    else:
        spans = [sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                        value[:, :, start:end], None, is_causal=True, **kwargs)[0]
                 for start, end in zip(row_bounds, row_bounds[1:], strict=False)]
    return torch.cat(spans, dim=1), None


def fused_kernels():
    """The SDPA kernels allowed on a GPU: the fused ones, whose memory grows with T, never the math
    kernel, which builds T x T scores (64 GiB at 32,768 tokens and 16 heads in float32)."""
    from torch.nn.attention import SDPBackend  # CLI start-up time

    return [backend for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                    getattr(SDPBackend, "CUDNN_ATTENTION", None)) if backend is not None]


def fused_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                           dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of one row with a fused kernel: query (1, H, n, D), key and value
    (1, H_kv, n, D) -> (1, n, H, D). Grouped K/V are copied per query head first: the
    memory-efficient kernel, float32's, takes no grouped heads (with `enable_gqa`, float32 fell to
    the math kernel). No fused kernel for these rows is one line, never a silent fall back."""
    from torch.nn.attention import sdpa_kernel  # CLI start-up time

    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    try:
        with sdpa_kernel(fused_kernels()):
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                                   dropout_p=dropout)
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        raise UnsupportedModelError(
            f"no fused attention kernel runs a packed row of {query.shape[2]:,} tokens in {query.dtype} with head "
            f"dim {query.shape[3]} on {query.device} (cleaner never falls back to the math kernel, which builds T x T "
            "scores); try --compute-dtype bfloat16") from error
    return out.transpose(1, 2).contiguous()


def _no_mask(*args, **kwargs) -> None:
    """The mask of packed_sdpa_attention: none; rows are kept apart by their bounds."""
    return None


@functools.cache
def _register_packed_attention() -> None:
    from transformers import AttentionInterface  # CLI start-up time
    from transformers.masking_utils import AttentionMaskInterface  # CLI start-up time

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def packed_attention_for(device: torch.device, compute_dtype: torch.dtype) -> str:
    """Flash attention's varlen kernel where it can run (CUDA, installed, 16-bit), else ours."""
    if device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16):
        from transformers.utils import is_flash_attn_2_available  # CLI start-up time

        if is_flash_attn_2_available():
            return FLASH_ATTENTION
    _register_packed_attention()
    return PACKED_ATTENTION


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, compute_dtype: torch.dtype) -> Iterator[None]:
    """The model attends over packed rows for the block (its own implementation restored after)."""
    own = model.config._attn_implementation
    wanted = packed_attention_for(next(model.parameters()).device, compute_dtype)
    if own == wanted:
        yield
        return
    model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


# ---------------------------------------------------------------------------
# The policy the step trains


class TrainablePolicy(torch.nn.Module):
    """A causal LM that maps a PackedBatch to TokenOutputs at its loss tokens."""

    def __init__(self, policy: torch.nn.Module, config: TrainConfig, entropy_grad: bool = False,
                 entropy: bool = True):
        super().__init__()
        check_plain_head(policy)
        check_attention(policy)  # sinks; a sliding window is checked against the rows (check_rows)
        self.policy = policy
        self.chunk_tokens = config.logits_chunk_tokens
        self.compute_dtype = COMPUTE_DTYPES[config.compute_dtype_on(next(policy.parameters()).device.type)]
        self.entropy_grad = entropy_grad  # entropy in the loss (entropy_coef > 0)
        self.entropy = entropy  # computed at all: the KL reference needs log-probs only

    def forward(self, batch: PackedBatch) -> TokenOutputs:
        # cache_enabled=False: autocast would keep a 16-bit copy of every weight for the whole step
        # (2 bytes per parameter); casting at each use costs a read of the weights instead
        with torch.autocast(batch.token_ids.device.type, dtype=self.compute_dtype,
                            enabled=self.compute_dtype != torch.float32, cache_enabled=False):
            hidden = self.hidden_states(batch)  # (N, H)
        predictors = hidden.index_select(0, batch.predictor_index)  # (M, H)
        # read after the decoder: under ZeRO-3 a tied head weight is the embedding's, which the
        # decoder gathers and releases; read here, it is gathered for (and released after) this forward
        head = self.policy.get_output_embeddings()
        return chunked_token_outputs(predictors, head.weight, head.bias, batch.target_ids, self.chunk_tokens,
                                     self.compute_dtype, self.entropy_grad, self.entropy)

    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """The decoder's last hidden states (after its final norm) of the packed rows; (N, H)."""
        longest = max(batch.row_lengths)
        with packed_attention(self.policy, self.compute_dtype):
            out = self.policy.get_decoder()(
                input_ids=batch.token_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                cu_seq_lens_q=batch.cu_seq_lens, cu_seq_lens_k=batch.cu_seq_lens, max_length_q=longest,
                max_length_k=longest, row_bounds=batch.row_bounds)
        return out.last_hidden_state[0]


def load_trainable(policy_path: str | Path, config: TrainConfig, device: str | torch.device,
                   model: torch.nn.Module | None = None) -> TrainablePolicy:
    """The policy to train (`model` if given, else loaded from `policy_path`), in float32 (its
    master weights) on `device`; the one loader of both engines. With a LoRA rank, a PeftModel
    whose adapters alone train (lora.py: a LoRA checkpoint's base and adapter, or new adapters)."""
    if config.lora_rank > 0:
        model = load_with_adapters(policy_path, config, device, model)
    else:
        model = load_policy(policy_path, device) if model is None else model.to(device)
    return TrainablePolicy(model, config, entropy_grad=config.entropy_coef > 0)


def load_reference(policy_path: str | Path, config: TrainConfig, device: str | torch.device) -> TrainablePolicy:
    """The frozen KL reference: the policy at `policy_path` as saved, in the compute dtype (bfloat16
    under --compute-dtype bfloat16: half the memory, the precision its no-grad forward runs in
    anyway), for step.ReferenceLogProbs to compute its log-probs once and free it."""
    dtype = COMPUTE_DTYPES[config.compute_dtype_on(torch.device(device).type)]
    frozen = load_policy(policy_path, device, dtype).eval().requires_grad_(False)
    return TrainablePolicy(frozen, config, entropy=False)


@contextlib.contextmanager
def training(policy: TrainablePolicy, config: TrainConfig, reentrant: bool = False) -> Iterator[None]:
    """Train mode, packed attention (which checkpointing's recomputation in backward needs too) and
    gradient checkpointing if configured, for the block; the model as it was after it. `reentrant`:
    torch's reentrant checkpointing, for ZeRO-3 with frozen weights (deepspeed_engine.py)."""
    model = policy.policy
    policy.train()
    if config.gradient_checkpointing:
        _checkpointing(model, enable=True, reentrant=reentrant)
    try:
        with packed_attention(model, policy.compute_dtype):
            yield
    finally:
        if config.gradient_checkpointing:
            _checkpointing(model, enable=False)
        policy.eval()


def _checkpointing(model: torch.nn.Module, enable: bool, reentrant: bool = False) -> None:
    """Gradient checkpointing on or off, non-reentrant unless asked (transformers'
    activation_checkpointing_*, the older gradient_checkpointing_* where that is all there is).
    Reentrant checkpointing trains a layer only if its input requires grad, which frozen embeddings'
    output does not: the input embeddings' output is made to."""
    if enable:
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if reentrant:
            model.enable_input_require_grads()
        return
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    model.disable_input_require_grads()  # the hook enabling adds breaks inference-mode generation
