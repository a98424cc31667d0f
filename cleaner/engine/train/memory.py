"""What training will take on a GPU, estimated before it starts (docs/running.md, "Will it fit").

`plan(...)` adds up, per device:
- static memory: the policy's weights, gradients and AdamW moments (float32, cleaner's master copy;
  under DeepSpeed's bf16 mode bfloat16 weights and gradients and a float32 master copy in the
  optimiser), each divided by the ranks where the ZeRO stage partitions it (1: the optimiser,
  2: + gradients, 3: + weights). bfloat16 autocast keeps no cached 16-bit copy of the weights
  (policy.py turns its cache off: 2 bytes per parameter, 8 GB at 4B, for a cast per use); AdamW is
  the fused one on a GPU, with no step-sized temporaries (optim.py);
- the KL reference, in the compute dtype: it runs alone, before the policy is built
  (step.ReferenceLogProbs), so it counts against the peak only through that pass;
- with LoRA (`trainable`: the adapters' parameters), gradients and moments of the adapters alone,
  the base frozen beside them, and no reference model: the reference is the base, its adapters
  disabled, a no-grad forward of each micro batch before the policy's (lora.py);
- activations of the longest micro batch: per token and layer, `ACTIVATION_ELEMENTS` values saved
  for backward (all layers without checkpointing; with it, each layer's input plus one layer's
  full set, recomputed), and the chunked head's two chunk x vocabulary float32 copies plus the
  hidden states it reads.
Two sets of coefficients, apart: `CPU` calibrated on the float32 proxy against measured peaks
(BENCHMARKS.md, "Will it fit"), and `CUDA` on an H100's peaks (bfloat16 autocast, checkpointing,
the KL term, fused AdamW: Qwen3-0.6B, -1.7B and -4B at 20,480 and 40,960 tokens a micro batch,
BENCHMARKS.md, "Training on a GPU"), where a checkpointed layer keeps about 2.3 bytes per token and
hidden unit (its input, in the compute dtype) and the layer recomputed in backward 1 byte per
token for each of its ~10 h + 5 i values; float32 compute is taken at twice those (not measured).
An estimate, not a promise. A margin on the activations (`margin`: the allocator's fragmentation)
and a fixed allowance (`overhead`: CUDA's context, kernels' workspaces) are added. `refusal` turns
a plan that does not fit into one line naming what would make it fit; the trainer plans against
the memory the device has free (with what this process already holds), and sets the CUDA
allocator's expandable segments unless the user chose a setting (cli/common.py: fragmentation
cost a 4B step at 40,960 tokens its fit on an 80 GB GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cleaner.engine.train.space import human_bytes

# Values saved for backward per token and decoder layer, in units of the hidden size and of the
# MLP's intermediate size (q, k, v, attention output, norms and residuals ~ 10 h; gate, up,
# activation, product ~ 5 i).
ACTIVATION_ELEMENTS = (10.0, 5.0)


@dataclass(frozen=True)
class Coefficients:
    """Bytes per saved value, by what is saved, and the allowances of one kind of device."""

    layer_input_bytes: float  # a checkpointed layer's input: per token and hidden unit
    layer_value_bytes: float  # each of a layer's saved values (ACTIVATION_ELEMENTS) per token
    head_copies: int  # chunk x vocabulary float32 logits alive at once in the chunked head
    margin: float  # on activations and the head: the caching allocator's fragmentation
    overhead: int  # bytes: CUDA's context, kernels' workspaces


# The float32 proxy on this CPU (bfloat16 autocast saves matmul inputs in 16 bits, norms in 32: 3 bytes).
CPU = {"float32": Coefficients(4.0, 4.0, 2, 1.3, 2**30), "bfloat16": Coefficients(3.0, 3.0, 2, 1.3, 2**30)}
# An H100, bfloat16 (module notes); float32 at twice the activations (no T x T scores: policy.py).
CUDA = {"bfloat16": Coefficients(2.3, 1.0, 1, 1.1, 2**29), "float32": Coefficients(4.6, 2.0, 1, 1.1, 2**29)}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model's config."""

    parameters: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config, parameters: int) -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(parameters, int(text.hidden_size), int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
                   int(text.num_hidden_layers), int(text.vocab_size))


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes per device
    gradients: int
    optimizer: int
    autocast_copy: int  # a 16-bit copy of the weights held during the step (0: autocast caches none)
    reference: int  # the KL reference's pass (before the policy exists)
    activations: int  # the longest micro batch's
    head: int  # the chunked head's logits and the hidden states it reads
    device_bytes: int | None  # what the device holds; None when unknown (CPU)

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.autocast_copy

    @property
    def training(self) -> int:
        return self.static + self.activations + self.head

    margin: float = 1.3  # on activations and the head (Coefficients)
    overhead: int = 2**30  # bytes beside everything (Coefficients)

    @property
    def peak(self) -> int:
        """The larger of the reference's pass (no gradient: a quarter of the activations, about) and
        the training, with the margins."""
        transient = self.margin * (self.activations + self.head)
        return int(self.overhead + max(self.static + transient, self.reference + transient / 4))

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes


def plan(shape: ModelShape, *, micro_tokens: int, compute_dtype: str, checkpointing: bool, kl: bool,
         chunk_tokens: int, engine: str = "torch", zero_stage: int = 0, world_size: int = 1,
         device_bytes: int | None = None, device_type: str = "cuda", trainable: int | None = None) -> MemoryPlan:
    """The estimate of one device's memory (module notes). `micro_tokens`: the longest micro batch;
    `device_type`: whose coefficients ("cuda", or "cpu": the proxy's); `trainable`: LoRA's adapter
    parameters, beside the frozen `shape.parameters` (None: every parameter trains)."""
    p, bf16 = shape.parameters, compute_dtype in ("bfloat16", "float16")  # 16-bit compute: one cost
    t = p if trainable is None else trainable  # what has gradients and AdamW's moments
    frozen = 0 if trainable is None else p
    table = CUDA if device_type == "cuda" else CPU
    coefficients = table["bfloat16" if bf16 else "float32"]
    n = max(world_size, 1)
    if engine == "deepspeed" and bf16:  # DeepSpeed's bf16/fp16: 16-bit weights and gradients, fp32 master
        weights, gradients, optimizer, autocast = 2 * (t + frozen), 2 * t, 12 * t, 0
    else:  # float32 weights, gradients and two moments; autocast casts per use (no cached copy)
        weights, gradients, optimizer, autocast = 4 * (t + frozen), 4 * t, 8 * t, 0
    if engine == "deepspeed":
        optimizer //= n if zero_stage >= 1 else 1
        gradients //= n if zero_stage >= 2 else 1
        weights //= n if zero_stage >= 3 else 1
    layer = (ACTIVATION_ELEMENTS[0] * shape.hidden + ACTIVATION_ELEMENTS[1] * shape.intermediate) \
        * coefficients.layer_value_bytes  # bytes a token saves of one layer's full set
    if checkpointing:  # every layer's input, and the one layer recomputed in backward
        per_token = shape.layers * shape.hidden * coefficients.layer_input_bytes + layer
    else:  # every layer's full set (its input among them)
        per_token = shape.layers * layer
    activations = int(micro_tokens * per_token)
    head = coefficients.head_copies * min(chunk_tokens, micro_tokens) * shape.vocab * 4 + 2 * micro_tokens * shape.hidden * 4
    reference = p * (2 if bf16 else 4) if kl and trainable is None else 0  # LoRA's is the base, disabled adapters
    return MemoryPlan(weights, gradients, optimizer, autocast, reference, activations, head, device_bytes,
                      coefficients.margin, coefficients.overhead)


def refusal(memory: MemoryPlan, *, what: str, checkpointing: bool, compute_dtype: str, engine: str,
            zero_stage: int, micro_tokens: int) -> str | None:
    """The one line refusing a plan that does not fit, naming the knobs that would help; None if it fits."""
    if memory.fits:
        return None
    knobs = []
    if not checkpointing:
        knobs.append("--gradient-checkpointing")
    if compute_dtype not in ("bfloat16", "float16"):
        knobs.append("--compute-dtype bfloat16")
    if micro_tokens > 4096:
        knobs.append(f"a smaller --max-tokens-per-micro-batch (the longest micro batch is {micro_tokens:,} tokens)")
    if engine != "deepspeed" or zero_stage < 3:
        knobs.append("--engine deepspeed with ZeRO-3 over more GPUs" if engine == "deepspeed"
                     else "--engine deepspeed (ZeRO-2/3 over several GPUs)")
    return (f"{what}: training needs about {human_bytes(memory.peak)} on the GPU and it has "
            f"{human_bytes(memory.device_bytes or 0)} (static {human_bytes(memory.static)}: weights, gradients, "
            f"AdamW; activations {human_bytes(memory.activations)}; head {human_bytes(memory.head)}"
            f"{f'; the KL reference {human_bytes(memory.reference)}, before' if memory.reference else ''}); "
            f"try {', '.join(knobs) or 'a GPU with more memory'} (estimated before training)")


ALLOCATOR_SETTING = "PYTORCH_CUDA_ALLOC_CONF"


def expandable_segments() -> None:
    """Let the CUDA caching allocator grow its segments (verl's `set_expandable_segments`), unless
    the user chose an allocator setting: fragmentation otherwise holds back gigabytes a long step
    needs. Set in the environment for what starts CUDA later, and in the allocator already running."""
    if ALLOCATOR_SETTING in os.environ:
        return
    os.environ[ALLOCATOR_SETTING] = "expandable_segments:True"
    import torch  # CLI start-up time

    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)  # torch's own, since 2.1
    if setter is not None and torch.cuda.is_available():
        setter("expandable_segments:True")


def available_bytes(device) -> int:
    """What a GPU has for training now: its free memory and what this process's allocator holds
    (the model already there, the cache), not its total (another process, or an engine that
    released less than it held, may have the rest)."""
    import torch  # CLI start-up time

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def out_of_memory_hint() -> str:
    """What an out-of-memory error during training is told to try."""
    return ("try --gradient-checkpointing, --compute-dtype bfloat16, a smaller --max-tokens-per-micro-batch, "
            "or --engine deepspeed with ZeRO-2/3 over several GPUs; `cleaner train` estimates the memory "
            "before training (docs/running.md, 'Will it fit')")


def parameter_count(config) -> int:
    """The parameters a config's model has, counted on the meta device (nothing allocated)."""
    import torch  # CLI start-up time
    from transformers import AutoModelForCausalLM  # CLI start-up time

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


