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
- activations of the longest micro batch: per token and layer, `ACTIVATION_ELEMENTS` values saved
  for backward (all layers without checkpointing; with it, each layer's input plus one layer's
  full set, recomputed), and the chunked head's two chunk x vocabulary float32 copies plus the
  hidden states it reads.
The coefficients are calibrated on this CPU against measured peaks (BENCHMARKS.md, "Will it fit"):
an estimate, not a promise. A margin on the activations (`ACTIVATION_MARGIN`: the allocator's
fragmentation) and a fixed allowance (`OVERHEAD_BYTES`: CUDA's context, kernels' workspaces) are
added. `refusal` turns a plan that does not fit into one line naming what would make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleaner.engine.train.space import human_bytes

# Values saved for backward per token and decoder layer, in units of the hidden size and of the
# MLP's intermediate size (q, k, v, attention output, norms and residuals ~ 10 h; gate, up,
# activation, product ~ 5 i), calibrated on the float32 proxy (BENCHMARKS.md, "Will it fit").
ACTIVATION_ELEMENTS = (10.0, 5.0)
LAYER_INPUT_ELEMENTS = 1.0  # what checkpointing keeps of a layer: its input, h values per token
ACTIVATION_MARGIN = 1.3  # on activations and the head: the caching allocator's fragmentation
OVERHEAD_BYTES = 2**30  # CUDA's context and kernels' workspaces


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

    @property
    def peak(self) -> int:
        """The larger of the reference's pass (no gradient: a quarter of the activations, about) and
        the training, with the margins."""
        transient = ACTIVATION_MARGIN * (self.activations + self.head)
        return int(OVERHEAD_BYTES + max(self.static + transient, self.reference + transient / 4))

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes


def plan(shape: ModelShape, *, micro_tokens: int, compute_dtype: str, checkpointing: bool, kl: bool,
         chunk_tokens: int, engine: str = "torch", zero_stage: int = 0, world_size: int = 1,
         device_bytes: int | None = None) -> MemoryPlan:
    """The estimate of one device's memory (module notes). `micro_tokens`: the longest micro batch."""
    p, bf16 = shape.parameters, compute_dtype == "bfloat16"
    n = max(world_size, 1)
    if engine == "deepspeed" and bf16:  # DeepSpeed's bf16: 16-bit weights and gradients, fp32 master
        weights, gradients, optimizer, autocast = 2 * p, 2 * p, 12 * p, 0
    else:  # float32 weights, gradients and two moments; autocast casts per use (no cached copy)
        weights, gradients, optimizer, autocast = 4 * p, 4 * p, 8 * p, 0
    if engine == "deepspeed":
        optimizer //= n if zero_stage >= 1 else 1
        gradients //= n if zero_stage >= 2 else 1
        weights //= n if zero_stage >= 3 else 1
    value_bytes = 3 if bf16 else 4  # bfloat16 autocast saves matmul inputs in 16 bits, norms in 32
    per_layer = ACTIVATION_ELEMENTS[0] * shape.hidden + ACTIVATION_ELEMENTS[1] * shape.intermediate
    if checkpointing:
        elements = micro_tokens * (shape.layers * LAYER_INPUT_ELEMENTS * shape.hidden + per_layer)
    else:
        elements = micro_tokens * shape.layers * per_layer
    activations = int(elements * value_bytes)
    head = 2 * min(chunk_tokens, micro_tokens) * shape.vocab * 4 + 2 * micro_tokens * shape.hidden * 4
    reference = p * value_bytes if kl else 0
    return MemoryPlan(weights, gradients, optimizer, autocast, reference, activations, head, device_bytes)


def refusal(memory: MemoryPlan, *, what: str, checkpointing: bool, compute_dtype: str, engine: str,
            zero_stage: int, micro_tokens: int) -> str | None:
    """The one line refusing a plan that does not fit, naming the knobs that would help; None if it fits."""
    if memory.fits:
        return None
    knobs = []
    if not checkpointing:
        knobs.append("--gradient-checkpointing")
    if compute_dtype != "bfloat16":
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


def out_of_memory_hint() -> str:
    """What an out-of-memory error during training is told to try."""
    return ("try --gradient-checkpointing, --compute-dtype bfloat16, a smaller --max-tokens-per-micro-batch, "
            "or --engine deepspeed with ZeRO-2/3 over several GPUs; `cleaner train` estimates the memory "
            "before training (docs/running.md, 'Will it fit')")


def gib(value: int) -> float:
    return value / 2**30


def parameter_count(config) -> int:
    """The parameters a config's model has, counted on the meta device (nothing allocated)."""
    import torch  # CLI start-up time
    from transformers import AutoModelForCausalLM  # CLI start-up time

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


