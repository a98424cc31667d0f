"""The "Will it fit" table of docs/running.md: cleaner's memory estimate (cleaner/engine/train/memory.py)
for Qwen3 models on 80 GB GPUs, the torch engine on one and DeepSpeed ZeRO-2/3 on 8.

Shapes are the Qwen3 configs' (hidden, intermediate, layers, heads, vocabulary), parameters counted
on the meta device; training in bfloat16 with gradient checkpointing, micro batches of 16,384 tokens,
the KL term on, lm_head chunks of 512. An estimate, not a measurement: no GPU has run it here. `--lora`: the LoRA table (one GPU, the
whole model against adapters of rank 8 and 64 on every linear layer, with the same settings).

    .venv/bin/python bench/memory_plan.py
    .venv/bin/python bench/memory_plan.py --lora --micro-tokens 23040
"""

from __future__ import annotations

import argparse

from transformers import Qwen3Config

from cleaner.engine.train import memory

GPU_BYTES = 80 * 10**9
QWEN3 = {  # from the models' config.json
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
SETUPS = [("torch, 1 GPU", "torch", 0, 1), ("DeepSpeed ZeRO-2, 8 GPUs", "deepspeed", 2, 8),
          ("DeepSpeed ZeRO-3, 8 GPUs", "deepspeed", 3, 8)]


def table(micro_tokens: int) -> str:
    lines = [f"| model (parameters) | {' | '.join(name for name, *_ in SETUPS)} |",
             "| --- |" + " --- |" * len(SETUPS)]
    for name, shape in QWEN3.items():
        config = Qwen3Config(vocab_size=151_936, **shape)
        parameters = memory.parameter_count(config)
        cells = []
        for _, engine, stage, gpus in SETUPS:
            plan = memory.plan(memory.ModelShape.of(config, parameters), micro_tokens=micro_tokens,
                               compute_dtype="bfloat16", checkpointing=True, kl=True, chunk_tokens=512,
                               engine=engine, zero_stage=stage, world_size=gpus, device_bytes=GPU_BYTES)
            cells.append(f"{'fits' if plan.fits else 'does not fit'}: {plan.peak / 1e9:.0f} GB "
                         f"(static {plan.static / 1e9:.0f})")
        lines.append(f"| {name} ({parameters / 1e9:.2f}B) | {' | '.join(cells)} |")
    return "\n".join(lines)


# Qwen2.5-7B-Instruct's config.json (the recipes' 7B): a Qwen2, untied, 152,064 tokens
QWEN2_7B = dict(vocab_size=152_064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
LORA_RANKS = (8, 64)


def lora_models() -> dict[str, object]:
    from transformers import Qwen2Config

    models = {name: Qwen3Config(vocab_size=151_936, **QWEN3[name]) for name in ("Qwen3-4B", "Qwen3-8B")}
    return {**models, "Qwen2.5-7B": Qwen2Config(**QWEN2_7B)}


def lora_table(micro_tokens: int) -> str:
    """The torch engine on one 80 GB GPU, the whole model trained against LoRA adapters on every
    linear layer (`--lora-target-modules all-linear`) of rank 8 and 64, the KL term on."""
    import torch
    from transformers import AutoModelForCausalLM

    from cleaner.config import TrainConfig
    from cleaner.engine.train.lora import adapter_parameters

    lines = ["| model (parameters) | full | " + " | ".join(f"LoRA r={rank} (adapters)" for rank in LORA_RANKS) + " |",
             "| --- |" + " --- |" * (1 + len(LORA_RANKS))]
    for name, config in lora_models().items():
        with torch.device("meta"):
            structure = AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in structure.parameters())
        trainable = [None] + [adapter_parameters(structure, TrainConfig(lora_rank=rank)) for rank in LORA_RANKS]
        cells = []
        for adapters in trainable:
            plan = memory.plan(memory.ModelShape.of(config, parameters), micro_tokens=micro_tokens,
                               compute_dtype="bfloat16", checkpointing=True, kl=True, chunk_tokens=512,
                               device_bytes=GPU_BYTES, trainable=adapters)
            what = "" if adapters is None else f" ({adapters / 1e6:.0f}M)"
            cells.append(f"{'fits' if plan.fits else 'does not fit'}: {plan.peak / 1e9:.0f} GB{what}")
        lines.append(f"| {name} ({parameters / 1e9:.2f}B) | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-tokens", type=int, default=16_384)
    parser.add_argument("--lora", action="store_true", help="the LoRA table: one GPU, full against adapters")
    args = parser.parse_args(argv)
    print(lora_table(args.micro_tokens) if args.lora else table(args.micro_tokens))


if __name__ == "__main__":
    main()
