"""Peak memory and time of one train micro batch at real shapes: the full-logits step vs cleaner's.

A Qwen3-architecture model with random weights, made in memory, trains one micro batch of two rows,
T and T/4 tokens, with the KL term on (a reference model of the same shape), forward and backward,
no optimizer step, through the function `cleaner train` calls per micro batch. Each probe runs in a
fresh process and prints one JSON line: peak resident memory (ru_maxrss), peak CUDA memory on a GPU,
seconds, tokens per second, loss and gradient norm, so the paths are compared side by side in one run:
  full          the plain step (`cleaner/engine/train/naive.py`): right-padded rows, (B, T, V) logits
  chunked       cleaner's step: packed rows, log-probs and entropy from hidden states in chunks
  chunked+gc    the same with --gradient-checkpointing
  chunked+bf16  the same with --compute-dtype bfloat16 (this CPU has no bfloat16 matmul: autocast
                is emulated there and takes many minutes per probe)
  chunked+gc+bf16  both (what bench/gpu_check.py runs on a GPU)
  <chunked path>+lora  the same step training rank-8 LoRA adapters on every linear layer (peft), the
                KL reference the base with them disabled (no second model); bench/lora_memory.py
                sets it beside the full step
Shapes: `proxy` (hidden 256, intermediate 768, 2 layers, 4 heads, 2 KV heads, head_dim 64, untied
embeddings) and `qwen3-0.6b` (Qwen3-0.6B's config: hidden 1024, 28 layers, tied embeddings), both
with the real 151,936-token vocabulary unless --vocab says otherwise. The full path grows with
T x V; it runs up to --full-max-tokens, under an address-space limit (--full-memory-limit-gb) so that
a size that does not fit fails in its own process instead of pushing the machine into swap.

    .venv/bin/python bench/train_memory.py --tokens 4096 --path chunked --json
    .venv/bin/python bench/train_memory.py --tokens 1024,4096,16384,32768 --write-benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # cleaner from this checkout, installed or not

REAL_VOCAB = 151_936
SHAPES = {
    "proxy": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": True},
}
FP32 = {"compute_dtype": "float32"}  # float32 stated: the default (auto) is bfloat16 on a GPU
PATHS = {"full": FP32, "full+bf16": {"compute_dtype": "bfloat16"}, "chunked": FP32,
         "chunked+gc": {"gradient_checkpointing": True, **FP32},
         "chunked+bf16": {"compute_dtype": "bfloat16"},
         "chunked+gc+bf16": {"gradient_checkpointing": True, "compute_dtype": "bfloat16"}}
LORA = {"lora_rank": 8, "lora_alpha": 16}  # `+lora`: rank-8 adapters on every linear layer (all-linear)
PATHS |= {f"{path}+lora": {**settings, **LORA} for path, settings in PATHS.items() if path.startswith("chunked")}
# the anchor on the proxy, these machines: verl's FusedLinearForPPO (chunk 512), rows unpadded
VERL_ANCHOR = {4096: (3.47, 34.0), 16384: (3.98, 144.0)}  # T: (max RSS GB, seconds)
SETUP = ("One micro batch of two rows (T and T/4 tokens) through forward and backward with the KL term on,"
         " on a Qwen3-architecture proxy with the real 151,936-token vocabulary (hidden 256, intermediate 768,"
         " 2 layers, 4 heads, 2 KV heads, head_dim 64, untied embeddings, float32, CPU, torch's default"
         " threads: 2), random weights made in memory, each probe in a fresh process; peak = its maximum"
         " resident memory, which includes the ~0.6 GB of Python, torch and the two models. `full` is the"
         " plain step (padded rows, (B, T, V) logits, `cleaner/engine/train/naive.py`), run under a"
         " {limit} GB address-space limit; `chunked` is cleaner's (packed rows, log-probs from hidden"
         " states a 512-token chunk of the lm_head at a time, the default); `+gc` adds --gradient-checkpointing."
         " Seconds: forward and backward of the micro batch. The loss and gradient norm columns show the"
         " paths computing the same step. GB here are GiB (2^30 bytes of ru_maxrss). The targets compare with"
         " verl's FusedLinearForPPO (chunk 512, rows unpadded) measured on the same proxy and machines: 3.47 GB"
         " and 34 s at T=4,096, 3.98 GB and 144 s at T=16,384.")


def proxy(seed: int, vocab_size: int, shape: str = "proxy", device: str = "cpu"):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, max_position_embeddings=65536, **SHAPES[shape])
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def rows(tokens: int, vocab_size: int):
    import torch

    from cleaner.records import PurifiedRow

    generator = torch.Generator().manual_seed(0)
    made = []
    for index, length in enumerate((tokens, max(tokens // 4, 2))):
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        prompt = length // 8
        made.append(PurifiedRow(
            config_id="bench", iteration=0, rollout_id=f"r{index}", group_id="g", token_ids=tuple(ids),
            prompt_len=prompt, loss_mask=(0,) * prompt + (1,) * (length - prompt),
            behavior_logprobs=(0.0,) * length, old_logprobs=(-12.0,) * length, reward=float(index),
            advantage=1.0 - 2 * index, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0,
            tokens_removed=0, scorer_version="bench"))
    return made


def micro_batch_step(path: str, model, reference, batch_rows, device: str, kl: bool = True):
    """Forward and backward of one micro batch on `path`; its MicroLoss. `reference`: the reference
    model (full path), or its log-probs computed before (cleaner's step: step.ReferenceLogProbs), or
    with LoRA `True`: the model's base, its adapters disabled, in the micro batch (lora.AdapterReference);
    None without the KL term."""
    from cleaner.config import TrainConfig
    from cleaner.engine.train.naive import full_logits_micro_batch_loss
    from cleaner.engine.train.packing import pack_rows
    from cleaner.engine.train.policy import TrainablePolicy, training
    from cleaner.engine.train.step import batch_totals, forward_micro_batch

    config = TrainConfig(kl_coef=0.1 if kl else 0.0, device=device, **PATHS[path])
    total = batch_totals(batch_rows, config)
    if path.startswith("full"):  # the plain step; in bfloat16 autocast for full+bf16
        import torch

        model.train()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=config.compute_dtype == "bfloat16"):
            part = full_logits_micro_batch_loss(model, reference, batch_rows, config, total)
        part.loss.backward()
        return part
    policy = TrainablePolicy(model, config)
    if reference is True:
        from cleaner.engine.train.lora import AdapterReference

        reference = AdapterReference(policy, policy)
    with training(policy, config):
        part = forward_micro_batch(policy, reference, batch_rows, pack_rows(batch_rows, device), config, total)
        part.loss.backward()
    return part


def reference_for(path: str, reference, batch_rows, device: str):
    """What `micro_batch_step` takes as its reference on `path`: the model itself (full), or its
    log-probs, computed in the compute dtype as the train step does before it trains."""
    if path.startswith("full"):
        return reference
    from cleaner.config import TrainConfig
    from cleaner.engine.train.policy import COMPUTE_DTYPES, TrainablePolicy
    from cleaner.engine.train.step import ReferenceLogProbs

    config = TrainConfig(kl_coef=0.1, device=device, **PATHS[path])
    frozen = TrainablePolicy(reference.to(COMPUTE_DTYPES[config.compute_dtype]), config, entropy=False)
    return ReferenceLogProbs.compute(frozen, batch_rows, config, device)


def probe(path: str, tokens: int, vocab_size: int, shape: str = "proxy", device: str = "cpu",
          repeat: int = 1, optimizer: bool = False, kl: bool = True) -> dict:
    """One micro batch forward and backward in this process (`repeat` times, the last one timed):
    peak memory, seconds, loss and gradient norm. With `optimizer`, each step ends with cleaner's
    AdamW (fused on a GPU), and on a GPU the static memory (weights and AdamW's moments, measured
    before the timed step) is reported apart from that step's peak above it, with the allocator's
    reserved peak and the model FLOPs utilisation. `kl`: the KL term (its reference) on."""
    import torch

    cuda = device.startswith("cuda")
    if cuda:  # float32 means float32 (the equality checks); bfloat16 autocast is unaffected
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batch_rows = rows(tokens, vocab_size)
    lora = path.endswith("+lora")
    # cleaner's step computes the reference's log-probs before the policy exists and frees the
    # reference (the full paths keep the reference model, as the plain step does); LoRA's is the
    # policy's own base, so no second model is made
    reference = (True if lora else reference_for(path, proxy(1, vocab_size, shape, device).eval()
                                                 .requires_grad_(False), batch_rows, device)) if kl else None
    model = proxy(0, vocab_size, shape, device)
    model = with_lora(model) if lora else model
    base = frozen_digest(model) if lora else None
    optimization = None
    if optimizer:
        from cleaner.config import TrainConfig
        from cleaner.engine.train.optim import new_optimization

        optimization = new_optimization(model, TrainConfig(lr=1e-6, device=device))
    static_mb = None
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            static_mb = torch.cuda.memory_allocated(device) / 2**20  # weights (and moments, after a step)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        part = micro_batch_step(path, model, reference, batch_rows, device, kl)
        if optimization is not None:
            optimization.advance(apply=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
                 if optimization is None else float("nan"))  # an optimiser step has set the gradients to None
    result = {"path": path, "shape": shape, "tokens": tokens, "rows": [len(r.token_ids) for r in batch_rows],
              "vocab": vocab_size, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "threads": torch.get_num_threads(), "optimizer": optimizer,
              "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds,
              "tokens_per_s": sum(len(r.token_ids) for r in batch_rows) / seconds, "loss": part.loss.item(),
              "entropy": float(part.entropy), "grad_norm": grad_norm, "kl": kl,
              "parameters": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if base is not None:  # measured after the peak: the digest reads each frozen weight once
        result["base_unchanged"] = frozen_digest(model) == base
    if cuda:
        from cleaner.engine.train.flops import model_flops_utilisation

        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        result["cuda_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        result["device_total_mb"] = torch.cuda.get_device_properties(device).total_memory / 2**20
        result["static_mb"] = static_mb
        result["step_above_static_mb"] = result["cuda_peak_mb"] - static_mb
        result["mfu"] = model_flops_utilisation(model.config, result["rows"], seconds, torch.cuda.get_device_name(device))
    return result


def with_lora(model):
    """The proxy with `LORA`'s adapters on every linear layer (a PeftModel)."""
    from cleaner.config import TrainConfig
    from cleaner.engine.train.lora import with_adapters

    return with_adapters(model, TrainConfig(**LORA), "proxy")


def frozen_digest(model) -> str:
    """sha256 of every frozen weight's bytes, one tensor at a time (no copy of the model)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            digest.update(name.encode())
            digest.update(memoryview(parameter.detach().cpu().contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()


def run_probe(path: str, tokens: int, vocab_size: int, shape: str = "proxy", device: str = "cpu",
              repeat: int = 1, memory_limit_gb: float | None = None, timeout_s: float | None = None,
              optimizer: bool = False, kl: bool = True) -> dict:
    """`probe` in a fresh process; a failure (out of memory included) is a row with its error."""
    command = [sys.executable, __file__, "--probe", path, "--tokens", str(tokens), "--vocab", str(vocab_size),
               "--shape", shape, "--device", device, "--repeat", str(repeat)] + (["--optimizer"] if optimizer else []) \
        + ([] if kl else ["--no-kl"])
    limit = None
    if memory_limit_gb:
        size = int(memory_limit_gb * 2**30)
        limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (size, size))  # noqa: E731
    try:
        # the trainer's allocator setting (cli/common.py: expandable segments unless the user set one)
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                       "expandable_segments:True")}
        done = subprocess.run(command, capture_output=True, text=True, check=False, preexec_fn=limit,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"path": path, "shape": shape, "tokens": tokens, "error": f"over {timeout_s:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        out_of_memory = ("can't allocate memory" in last or "MemoryError" in last or "out of memory" in last.lower()
                         or "OutOfMemoryError" in last)
        if out_of_memory and memory_limit_gb:
            last = f"out of memory under a {memory_limit_gb:g} GB limit"
        return {"path": path, "shape": shape, "tokens": tokens, "error": last, "out_of_memory": out_of_memory}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict], tokens: list[int]) -> str:
    by = {(r["path"], r["tokens"]): r for r in results}
    paths = list(dict.fromkeys(r["path"] for r in results))

    def cell(result: dict | None, key: str, scale: float, digits: int) -> str:
        if result is None:
            return "-"
        if "error" in result:
            return result["error"]
        return f"{result[key] / scale:,.{digits}f}"

    lines = ["| T (rows T + T/4) | " + " | ".join(f"{p} peak GB" for p in paths) + " | "
             + " | ".join(f"{p} s" for p in paths) + " | loss: full, chunked | grad norm: full, chunked |",
             "| --- |" + " --- |" * (2 * len(paths) + 2)]
    for count in tokens:
        memory = [cell(by.get((path, count)), "peak_mb", 1024, 2) for path in paths]
        seconds = [cell(by.get((path, count)), "seconds", 1, 1) for path in paths]
        full, chunked = by.get(("full", count)), by.get(("chunked", count))
        both = full and chunked and "loss" in full and "loss" in chunked
        losses = f"{full['loss']:.6f}, {chunked['loss']:.6f}" if both else "-"
        norms = f"{full['grad_norm']:.6f}, {chunked['grad_norm']:.6f}" if both else "-"
        lines.append(f"| {count:,} | " + " | ".join(memory + seconds) + f" | {losses} | {norms} |")
    return "\n".join(lines)


def growth(results: list[dict]) -> str:
    """Each path's peak growth per 1,024 tokens of T, between its smallest and largest T."""
    parts = []
    for path in dict.fromkeys(r["path"] for r in results):
        runs = sorted((r["tokens"], r["peak_mb"]) for r in results if r["path"] == path and "peak_mb" in r)
        if len(runs) >= 2:
            (t0, m0), (t1, m1) = runs[0], runs[-1]
            parts.append(f"{path} {(m1 - m0) / (t1 - t0):.3f} GB (T {t0:,} to {t1:,})")
    return "Peak growth per 1,024 tokens of T: " + "; ".join(parts) + "."


def targets(results: list[dict]) -> str:
    """The issue's targets on the proxy, each with what was measured and whether it holds."""
    by = {(r["path"], r["tokens"]): r for r in results if "peak_mb" in r}
    lines = []

    def check(name: str, measured: str, holds: bool) -> None:
        lines.append(f"| {name} | {measured} | {'yes' if holds else 'NO'} |")

    for path in ("chunked", "chunked+gc"):
        at = {t: by[(path, t)] for t in (1024, 4096, 16384, 32768) if (path, t) in by}
        if 4096 in at:
            check(f"{path}: T=4,096 peak <= 3.0 GB", f"{at[4096]['peak_mb'] / 1024:.2f} GB",
                  at[4096]["peak_mb"] <= 3.0 * 1024)
        if 16384 in at:
            check(f"{path}: T=16,384 peak <= 3.6 GB", f"{at[16384]['peak_mb'] / 1024:.2f} GB",
                  at[16384]["peak_mb"] <= 3.6 * 1024)
            check(f"{path}: T=16,384 in <= 1.1 x verl's 144 s", f"{at[16384]['seconds']:.0f} s",
                  at[16384]["seconds"] <= 1.1 * VERL_ANCHOR[16384][1])
        if 4096 in at and 16384 in at:
            grown = (at[16384]["peak_mb"] - at[4096]["peak_mb"]) / 1024
            check(f"{path}: growth T=4,096 to 16,384 < 1 GB", f"{grown:.2f} GB", grown < 1.0)
        if 32768 in at:
            check(f"{path}: T=32,768 completes", f"{at[32768]['peak_mb'] / 1024:.2f} GB, "
                  f"{at[32768]['seconds']:.0f} s", True)
        full = by.get(("full", 1024))
        if full and 1024 in at:
            ours, theirs = at[1024]["seconds"], full["seconds"]
            check(f"{path}: time per token at T=1,024 no worse than full", f"{ours:.2f} s vs {theirs:.2f} s",
                  ours <= theirs)
    return "| target | measured | holds |\n| --- | --- | --- |\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096,16384,32768", help="T values, comma-separated")
    parser.add_argument("--vocab", "--vocab-size", dest="vocab", type=int, default=REAL_VOCAB)
    parser.add_argument("--path", "--paths", dest="paths", default="full,chunked,chunked+gc",
                        help="comma-separated: " + ", ".join(PATHS))
    parser.add_argument("--shape", choices=list(SHAPES), default="proxy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=1, help="steps per probe, the last one timed")
    parser.add_argument("--full-max-tokens", type=int, default=4096, help="largest T the full-logits path runs at")
    parser.add_argument("--full-memory-limit-gb", type=float, default=20.0,
                        help="address-space limit of a full-path probe (0: none)")
    parser.add_argument("--json", action="store_true", help="print the probes' JSON lines only")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", action="store_true", help="end each step with cleaner's AdamW step")
    parser.add_argument("--no-kl", dest="kl", action="store_false", help="the KL term off (no reference)")
    parser.add_argument("--write-benchmarks", action="store_true", help="replace BENCHMARKS.md's section")
    args = parser.parse_args()
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown path(s) {sorted(unknown)}; choose from {list(PATHS)}")
    if args.probe:
        print(json.dumps(probe(args.probe, int(args.tokens), args.vocab, args.shape, args.device, args.repeat,
                               args.optimizer, args.kl)))
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for count in tokens:
        for path in args.paths.split(","):
            if path == "full" and count > args.full_max_tokens:
                continue
            limit = args.full_memory_limit_gb if path == "full" else None
            result = run_probe(path, count, args.vocab, args.shape, args.device, args.repeat, limit)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.json:
        return
    text = "\n\n".join([table(results, tokens), growth(results), targets(results)])
    print(text)
    if args.write_benchmarks:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from benchmarks_md import write_section

        heading = "## Training at real shapes: peak memory of one micro batch"
        command = (f"    .venv/bin/python bench/train_memory.py --tokens {args.tokens} --path {args.paths}"
                   f" --full-max-tokens {args.full_max_tokens} --write-benchmarks")
        setup = SETUP.format(limit=f"{args.full_memory_limit_gb:g}")
        write_section(heading, f"{heading}\n\n{command}\n\n{setup}\n\n{text}\n")


if __name__ == "__main__":
    main()
