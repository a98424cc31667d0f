"""The one GPU acceptance run (`make gpu-check`, under 8 minutes on one H100): one table, a holds /
does-not column per target, and the probes' own tables beneath it.

Targets (on CUDA):
1. Equality: cleaner's chunked step against the full-logits step on a Qwen3-0.6B-shaped random
   model in float32 (TF32 off) at a small T: loss within 1e-4, gradient norm within 1e-3 relative.
2. float32 never goes quadratic: with gradient checkpointing at T = 16,384 (rows T and T/4, the KL
   term on, AdamW's step), float32's step takes at most 2x bfloat16's memory above the weights, and
   T = 32,768 completes in both.
3. The memory estimate (cleaner/engine/train/memory.py) lies within [allocated, 1.10 x reserved]
   of the measured peaks for Qwen3-1.7B and -4B (20,480 and 40,960 tokens a micro batch) and the
   paper's setting (4B, 23,040-token micro batches, KL off); within 15% of allocated for 0.6B.
4. Purify's trie scorer against one naive forward per row (4 rows x 8,192 tokens, a 512-token
   prompt, two rows sharing 4,096 tokens, Qwen3-0.6B, float32): at most half the naive pass's
   peak above the weights, no slower, values within 1e-4.
5. The torch backend's rollouts on the GPU are the CPU's, token for token (64 toy prompts, the
   tiny policy, temperature 1).
6. float16, the paper's dtype (bench/gpu_float16.py: 0.6B, 4,096 tokens, the trainer's two steps):
   loss within 2e-2 and gradient norm within 5% of float32's; a forced overflow skipped (weights
   unchanged, grad norm non-finite, scale halved, schedule moved on); the scale saved and resumed.
7. LoRA (rank 8 on every linear layer, the KL reference the base with the adapters disabled, AdamW
   on the adapters; bfloat16, checkpointing, T = 16,384 on 0.6B): its step's peak at most 0.6x the
   full step's (target 2's bfloat16 probe), the base unchanged bit for bit, and the memory estimate
   within 15% of the allocated peak. It needs peft, which the device image lacks: there its row and
   targets say "skipped: peft is not installed here" (pip install peft to measure them).
And the model FLOPs utilisation of the 4B step (no target: reported).

Every probe runs in a fresh process (a failure, out of memory included, is a row of its table, and
only fails the targets that need it). The script exits 0 when every target holds. Where there is no
CUDA it runs the same probes on the CPU proxy (small, quick); targets about GPU memory, speed or the
GPU's rollouts say n/a there. It needs torch, transformers and pyarrow only (the device image's):
tests/bench/test_gpu_check.py runs it with a python that has those but not cleaner installed, and
polars, duckdb, deepspeed and sglang hidden. Results: one JSON line per probe on stdout, and
gpu_check.json and gpu_check.md in --out ($OUT when set). The co-located collect -> train ->
collect (bench/gpu_colocated.py) follows where sglang, duckdb and polars are installed.

    python3 bench/gpu_check.py            # what `make gpu-check` runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # cleaner from this checkout: no PYTHONPATH
from train_memory import REAL_VOCAB, SHAPES, run_probe  # noqa: E402

MIN_TRANSFORMERS = (5, 0)  # the packed attention registers with AttentionInterface (transformers 5)
LOSS_ATOL = 1e-4  # float32 on a GPU, 28 layers: reductions run in another order than the full path's
GRAD_NORM_RTOL = 1e-3
SCORE_ATOL = 1e-4
FP16_LOSS_ATOL = 2e-2  # float16's 11-bit mantissa against float32 (the CPU test's bound too)
FP16_GRAD_NORM_RTOL = 5e-2


def check_transformers() -> None:
    """One line and exit 1 where transformers is missing or older than the train step needs."""
    try:
        import transformers
    except ImportError:
        sys.exit("error: gpu check: transformers is not installed here; pip install 'transformers>=5.0'")
    found = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if found < MIN_TRANSFORMERS:
        sys.exit(f"error: gpu check: transformers {transformers.__version__} is installed; the train step "
                 f"needs {'.'.join(map(str, MIN_TRANSFORMERS))} or newer (pip install 'transformers>=5.0')")


# ---------------------------------------------------------------------------------------------
# What runs, on a GPU and on the CPU proxy


@dataclass(frozen=True)
class Sizes:
    """The shapes and token counts of a run: the real ones on CUDA, a proxy's on the CPU."""

    cuda: bool
    vocab: int
    small: int  # T of the equality pair
    scale: tuple[int, int]  # T of the float32 / bfloat16 probes (16k, 32k)
    fits: tuple[tuple[str, int, bool], ...]  # (shape, T, KL) of the estimate probes
    scorer: tuple[int, int, int, int]  # rows, tokens a row, prompt, tokens two rows share
    shape: str  # of the equality, scale, scorer and float16 probes
    float16: int = 192  # tokens of the float16 probe's four rows

    @classmethod
    def of(cls, cuda: bool, vocab: int | None) -> Sizes:
        if cuda:
            return cls(True, vocab or REAL_VOCAB, 512, (16_384, 32_768),
                       (("qwen3-1.7b", 16_384, True), ("qwen3-4b", 16_384, True), ("qwen3-4b", 32_768, True),
                        ("qwen3-4b", 18_432, False)), (4, 8192, 512, 4096), "qwen3-0.6b", 4096)
        return cls(False, vocab or 512, 48, (96, 192), (("proxy", 64, True), ("proxy", 72, False)),
                   (4, 256, 32, 128), "proxy")


def has_peft() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


LORA_SKIPPED = "skipped: peft is not installed here (pip install peft)"


def train_plan(sizes: Sizes) -> list[dict]:
    """Every train probe, in order: name, path, shape, T, KL, timed steps, AdamW."""
    small, (mid, large) = sizes.small, sizes.scale
    shape = sizes.shape
    probes = [dict(name="equality full", path="full", shape=shape, tokens=small, kl=True, repeat=1, optimizer=False),
              dict(name="equality chunked", path="chunked", shape=shape, tokens=small, kl=True, repeat=1,
                   optimizer=False)]
    for tokens in (mid, large):
        probes.append(dict(name=f"bf16 {tokens}", path="chunked+gc+bf16", shape=shape, tokens=tokens, kl=True,
                           repeat=2, optimizer=True))
        probes.append(dict(name=f"fp32 {tokens}", path="chunked+gc", shape=shape, tokens=tokens, kl=True,
                           repeat=2, optimizer=True))
    probes.append(dict(name=f"bf16 no checkpointing {mid}", path="chunked+bf16", shape=shape, tokens=mid, kl=True,
                       repeat=2, optimizer=True))
    probes.append(dict(name=f"full-logits bf16 {mid}", path="full+bf16", shape=shape, tokens=mid, kl=True,
                       repeat=2, optimizer=True))
    for fit_shape, tokens, kl in sizes.fits:
        probes.append(dict(name=f"fit {fit_shape} {tokens}{'' if kl else ' KL off'}", path="chunked+gc+bf16",
                           shape=fit_shape, tokens=tokens, kl=kl, repeat=2, optimizer=True))
    probes.append(dict(name=f"lora bf16 {mid}", path="chunked+gc+bf16+lora", shape=shape, tokens=mid, kl=True,
                       repeat=2, optimizer=True))
    return probes


def micro_tokens(tokens: int) -> int:
    """A probe's micro batch: rows T and T/4."""
    return tokens + max(tokens // 4, 2)


# ---------------------------------------------------------------------------------------------
# The scorer and rollout probes (each in a fresh process: `--probe NAME`)


def _model(shape: str, vocab: int, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=65536, attn_implementation="sdpa",
                         **SHAPES[shape])
    with torch.device(device):
        return Qwen3ForCausalLM(config).eval()


def _scorer_rows(sizes: Sizes) -> tuple[list[list[int]], list[int]]:
    import random

    rows, tokens, prompt, shared = sizes.scorer
    rng = random.Random(0)
    head = [rng.randrange(sizes.vocab) for _ in range(prompt)]
    common = head + [rng.randrange(sizes.vocab) for _ in range(shared - prompt)]
    made = []
    for index in range(rows):
        start = common if index < 2 else head
        made.append(start + [rng.randrange(sizes.vocab) for _ in range(tokens - len(start))])
    return made, [prompt] * rows


def scorer_probe(kind: str, sizes: Sizes, device: str, out: Path) -> dict:
    """Purify's trie scorer (`trie`) or one naive forward per row (`naive`): seconds, peak above the
    weights, and the values (saved for the parent to compare)."""
    import numpy as np
    import torch

    from cleaner.engine.model.kv import causal_forward, target_logprobs
    from cleaner.engine.model.trie_scorer import PrefixTrieScorer

    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = _model(sizes.shape, sizes.vocab, device)
    sequences, starts = _scorer_rows(sizes)
    if cuda:
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    with torch.inference_mode():
        if kind == "trie":
            scored = PrefixTrieScorer(model, device=device).score_rows(sequences, starts)
        else:
            scored = []
            for sequence, start in zip(sequences, starts, strict=True):
                ids = torch.tensor([sequence], device=device)
                ones = torch.ones_like(ids)
                logits = causal_forward(model, ids, ones, torch.arange(len(sequence), device=device)[None]).logits
                scored.append(target_logprobs(logits[:, :-1], ids[:, 1:])[0, start - 1:].tolist())
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    np.save(out / f"scorer_{kind}.npy", np.array([value for row in scored for value in row], dtype=np.float64))
    result = {"probe": f"scorer {kind}", "seconds": seconds, "positions": sum(len(row) for row in scored)}
    if cuda:
        result["above_weights_gb"] = (torch.cuda.max_memory_allocated(device) - weights) / 1e9
    else:
        import resource

        result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return result


def rollouts_probe(device: str, out: Path) -> dict:
    """64 toy rollouts' first turns from the tiny policy on `device`, sampled at temperature 1."""
    from cleaner.config import DEFAULT_POLICY
    from cleaner.engine.collect.tasks import toy_tasks
    from cleaner.engine.model.base import SamplingParams
    from cleaner.engine.model.chat import ChatFormat
    from cleaner.engine.model.torch_backend import TorchBackend

    backend = TorchBackend(DEFAULT_POLICY, device=device)
    chat = ChatFormat(backend.tokenizer)
    prompts = [chat.prompt_ids(task.messages) for task in toy_tasks(64, seed=7)]
    started = time.perf_counter()
    generations = backend.generate(prompts, SamplingParams(160, tuple(chat.stop_token_ids), temperature=1.0),
                                   list(range(64)))
    seconds = time.perf_counter() - started
    backend.close()
    (out / f"rollouts_{device.split(':')[0]}.json").write_text(json.dumps(
        [[list(g.token_ids), list(g.logprobs)] for g in generations]))
    return {"probe": f"rollouts {device}", "seconds": seconds, "tokens": sum(len(g.token_ids) for g in generations)}


def float16_probe(sizes: Sizes, device: str) -> dict:
    """bench/gpu_float16.py's checks on the equality probes' shape."""
    from gpu_float16 import probe

    if device.startswith("cuda"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 is float32
    return probe(_model(sizes.shape, sizes.vocab, device), sizes.float16, sizes.vocab, device)


def run_side_probe(name: str, args: argparse.Namespace) -> dict:
    """A scorer or rollout probe in a fresh process; a failure is a row with its error."""
    command = [sys.executable, __file__, "--probe", name, "--device", args.device, "--out", str(args.out)] + (
        ["--vocab", str(args.vocab)] if args.vocab else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"probe": name, "error": f"over {args.timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"probe": name, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Targets


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    holds: bool | None  # None: not measured here (n/a)


def _above_gib(probe: dict) -> float | None:
    value = probe.get("step_above_static_mb")
    return None if value is None else value / 1024


def targets(sizes: Sizes, probes: dict[str, dict], side: dict[str, dict], out: Path) -> list[Target]:
    found = [equality_target(probes), *quadratic_targets(sizes, probes), *estimate_targets(sizes, probes),
             scorer_target(sizes, side, out), rollouts_target(sizes, side, out), *float16_targets(sizes, side),
             *lora_targets(sizes, probes)]
    fit = probes.get(f"fit qwen3-4b {sizes.fits[1][1]}") if sizes.cuda else None
    mfu = None if fit is None else fit.get("mfu")
    found.append(Target("MFU of the 4B step (20,480 tokens, AdamW): reported", "n/a (CPU)" if not sizes.cuda else
                        ("no figure (device not listed)" if mfu is None else f"{mfu:.1%}"), None))
    return found


def float16_targets(sizes: Sizes, side: dict[str, dict]) -> list[Target]:
    """The float16 probe's three checks (module notes, 6)."""
    names = (f"float16 step equals float32's within its rounding ({sizes.shape}, {sizes.float16:,} tokens): loss "
             f"within {FP16_LOSS_ATOL:g}, grad norm within {FP16_GRAD_NORM_RTOL:.0%}",
             "a forced float16 overflow is skipped: grad norm non-finite, weights unchanged, scale halved, "
             "the schedule moved on", "the float16 loss scale is saved with the checkpoint and resumed")
    result = side["float16 step"]
    if "error" in result:
        return [Target(name, f"the probe failed: {result['error']}", False) for name in names]
    losses = max(abs(a - b) for a, b in zip(result["fp16_losses"], result["fp32_losses"], strict=True))
    norms = max(abs(a - b) / b for a, b in zip(result["fp16_grad_norms"], result["fp32_grad_norms"], strict=True))
    return [Target(names[0], f"losses within {losses:.1e}, grad norms within {norms:.1%}",
                   losses <= FP16_LOSS_ATOL and norms <= FP16_GRAD_NORM_RTOL),
            Target(names[1], f"grad norm {result['overflow_grad_norm']}, skipped {result['overflow_skipped']}, "
                             f"halved {result['scale_halved']}, schedule moved {result['schedule_moved']}",
                   result["overflow_skipped"] and result["scale_halved"] and result["schedule_moved"]),
            Target(names[2], f"resumed scale {result['resumed_scale']:g}, growth interval {result['growth_interval']}",
                   result["scale_resumed"] and result["growth_interval"] == 400)]


def lora_targets(sizes: Sizes, probes: dict[str, dict]) -> list[Target]:
    """The LoRA probe's three checks (module notes, 7) against the full bfloat16 probe at its T."""
    mid = sizes.scale[0]
    lora, full = probes[f"lora bf16 {mid}"], probes[f"bf16 {mid}"]
    names = (f"LoRA step (rank 8, all-linear, KL on, T={mid:,}): peak at most 0.6x the full step's",
             "LoRA step leaves the base weights bit for bit",
             f"estimate of the LoRA step ({sizes.shape}, {micro_tokens(mid):,} tokens): within 15% of allocated")
    if lora.get("skipped"):
        return [Target(name, lora["skipped"], None) for name in names]
    if "error" in lora:
        return [Target(name, f"the probe failed: {lora['error']}", False) for name in names]
    unchanged = Target(names[1], f"base unchanged: {lora['base_unchanged']}", lora["base_unchanged"])
    if not sizes.cuda:
        return [Target(names[0], "n/a (CPU)", None), unchanged, Target(names[2], "n/a (CPU)", None)]
    allocated = lora["cuda_peak_mb"] * 2**20
    ratio = allocated / (full["cuda_peak_mb"] * 2**20) if "cuda_peak_mb" in full else None
    estimate = estimate_of(sizes.shape, sizes.vocab, micro_tokens(mid), True, None, lora["trainable"])
    return [Target(names[0], "the full probe failed" if ratio is None else f"{ratio:.2f}x ({allocated / 1e9:.2f} GB)",
                   ratio is not None and ratio <= 0.6), unchanged,
            Target(names[2], f"estimate {estimate.peak / 1e9:.2f} GB; allocated {allocated / 1e9:.2f} GB",
                   abs(estimate.peak - allocated) <= 0.15 * allocated)]


def equality_target(probes: dict[str, dict]) -> Target:
    full, chunked = probes["equality full"], probes["equality chunked"]
    name = f"chunked step equals the full-logits step (float32): loss within {LOSS_ATOL:g}, grad norm {GRAD_NORM_RTOL:g}"
    if "loss" not in full or "loss" not in chunked:
        return Target(name, f"a probe failed: {full.get('error') or chunked.get('error')}", False)
    holds = (abs(full["loss"] - chunked["loss"]) <= LOSS_ATOL
             and abs(full["grad_norm"] - chunked["grad_norm"]) <= GRAD_NORM_RTOL * abs(full["grad_norm"]))
    return Target(name, f"loss {full['loss']:.6f} / {chunked['loss']:.6f}, grad norm {full['grad_norm']:.6f} / "
                        f"{chunked['grad_norm']:.6f}", holds)


def quadratic_targets(sizes: Sizes, probes: dict[str, dict]) -> list[Target]:
    mid, large = sizes.scale
    fp32, bf16 = probes[f"fp32 {mid}"], probes[f"bf16 {mid}"]
    name = f"float32 at T={mid:,}: step memory above the weights at most 2x bfloat16's"
    if not sizes.cuda:
        first = Target(name, "n/a (CPU)", None)
    elif _above_gib(fp32) is None or _above_gib(bf16) is None:
        first = Target(name, f"a probe failed: {fp32.get('error') or bf16.get('error')}", False)
    else:
        first = Target(name, f"{_above_gib(fp32):.2f} GiB against {_above_gib(bf16):.2f} GiB",
                       _above_gib(fp32) <= 2 * _above_gib(bf16))
    completed = {dtype: "error" not in probes[f"{dtype} {large}"] for dtype in ("fp32", "bf16")}
    second = Target(f"T={large:,} completes in float32 and in bfloat16",
                    ", ".join(f"{dtype} {'completed' if ok else probes[f'{dtype} {large}']['error']}"
                              for dtype, ok in completed.items()), all(completed.values()))
    return [first, second]


def estimate_targets(sizes: Sizes, probes: dict[str, dict]) -> list[Target]:
    """The estimate of each bfloat16 probe's setting against its measured peaks."""
    checked = [(f"bf16 {tokens}", sizes.shape, tokens, True, True) for tokens in sizes.scale] + [
        (f"fit {shape} {tokens}{'' if kl else ' KL off'}", shape, tokens, kl, False) for shape, tokens, kl in sizes.fits]
    found = []
    for name, shape, tokens, kl, small_model in checked:
        label = (f"estimate of {shape}, {micro_tokens(tokens):,} tokens{'' if kl else ', KL off'}: "
                 + ("within 15% of allocated" if small_model else "within [allocated, 1.10 x reserved]"))
        probe = probes[name]
        if not sizes.cuda:
            found.append(Target(label, "n/a (CPU)", None))
            continue
        estimate = estimate_of(shape, sizes.vocab, micro_tokens(tokens), kl, probe.get("device_total_mb"))
        if "cuda_peak_mb" not in probe:
            fits = "refused" if not estimate.fits else "not refused"
            found.append(Target(label, f"{probe.get('error')}; the estimate {estimate.peak / 1e9:.2f} GB ({fits})",
                                not estimate.fits if probe.get("out_of_memory") else False))
            continue
        allocated, reserved = probe["cuda_peak_mb"] * 2**20, probe["cuda_reserved_mb"] * 2**20
        if small_model:
            holds = abs(estimate.peak - allocated) <= 0.15 * allocated
        else:
            holds = allocated <= estimate.peak <= 1.10 * reserved
        found.append(Target(label, f"estimate {estimate.peak / 1e9:.2f} GB; allocated {allocated / 1e9:.2f}, "
                                   f"reserved {reserved / 1e9:.2f} GB", holds))
    return found


def estimate_of(shape: str, vocab: int, tokens: int, kl: bool, device_mb: float | None, trainable: int | None = None):
    from transformers import Qwen3Config

    from cleaner.engine.train import memory

    config = Qwen3Config(vocab_size=vocab, **SHAPES[shape])
    parameters = memory.parameter_count(config)
    return memory.plan(memory.ModelShape.of(config, parameters), micro_tokens=tokens,
                       compute_dtype="bfloat16", checkpointing=True, kl=kl, chunk_tokens=512, device_type="cuda",
                       device_bytes=None if device_mb is None else int(device_mb * 2**20), trainable=trainable)


def scorer_target(sizes: Sizes, side: dict[str, dict], out: Path) -> Target:
    import numpy as np

    rows, tokens, *_ = sizes.scorer
    name = (f"trie scorer against a naive pass ({rows} rows x {tokens:,}): at most half its peak above the "
            f"weights, no slower, values within {SCORE_ATOL:g}")
    trie, naive = side["scorer trie"], side["scorer naive"]
    if "error" in trie or "error" in naive:
        return Target(name, f"a probe failed: {trie.get('error') or naive.get('error')}", False)
    difference = float(np.abs(np.load(out / "scorer_trie.npy") - np.load(out / "scorer_naive.npy")).max())
    if not sizes.cuda:
        return Target(name, f"values within {difference:.1e} (memory and time: n/a on the CPU)",
                      difference <= SCORE_ATOL)
    holds = (trie["above_weights_gb"] <= 0.5 * naive["above_weights_gb"] and trie["seconds"] <= naive["seconds"]
             and difference <= SCORE_ATOL)
    return Target(name, f"{trie['above_weights_gb']:.2f} GB / {naive['above_weights_gb']:.2f} GB, "
                        f"{trie['seconds']:.2f} s / {naive['seconds']:.2f} s, values within {difference:.1e}", holds)


def rollouts_target(sizes: Sizes, side: dict[str, dict], out: Path) -> Target:
    name = "the torch backend's 64 rollouts on the GPU are the CPU's, token for token"
    if not sizes.cuda:
        return Target(name, "n/a (CPU)", None)
    gpu, cpu = side["rollouts cuda"], side["rollouts cpu"]
    if "error" in gpu or "error" in cpu:
        return Target(name, f"a probe failed: {gpu.get('error') or cpu.get('error')}", False)
    on_gpu = json.loads((out / "rollouts_cuda.json").read_text())
    on_cpu = json.loads((out / "rollouts_cpu.json").read_text())
    same = sum(a[0] == b[0] for a, b in zip(on_gpu, on_cpu, strict=True))
    worst = max((abs(x - y) for a, b in zip(on_gpu, on_cpu, strict=True) if a[0] == b[0]
                 for x, y in zip(a[1], b[1], strict=True)), default=0.0)
    return Target(name, f"{same} of 64 the same; their log-probs within {worst:.1e}", same == 64)


# ---------------------------------------------------------------------------------------------
# The report


def markdown(device: str, train: list[dict], side: list[dict], found: list[Target]) -> str:
    lines = [f"Device: {device}; `python bench/gpu_check.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             "| target | measured | holds |", "| --- | --- | --- |"]
    for target in found:
        verdict = "n/a" if target.holds is None else ("holds" if target.holds else "does not hold")
        lines.append(f"| {target.name} | {target.measured} | {verdict} |")
    lines += ["", "| probe | shape | T (rows T + T/4) | KL | peak allocated GB | reserved GB | static GB | "
              "step above static GB | tokens/s | seconds | MFU | loss |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for probe in train:
        if "skipped" in probe:
            lines.append(f"| {probe['name']} | {probe['shape']} | {probe['tokens']:,} | {'on' if probe['kl'] else 'off'}"
                         f" | {probe['skipped']} | - | - | - | - | - | - | - |")
            continue
        if "error" in probe:
            lines.append(f"| {probe['name']} | {probe['shape']} | {probe['tokens']:,} | {'on' if probe['kl'] else 'off'}"
                         f" | {probe['error']} | - | - | - | - | - | - | - |")
            continue
        gb = {key: (f"{probe[key] * 2**20 / 1e9:.2f}" if probe.get(key) is not None else "-")
              for key in ("cuda_peak_mb", "cuda_reserved_mb", "static_mb", "step_above_static_mb")}
        mfu = "-" if probe.get("mfu") is None else f"{probe['mfu']:.1%}"
        lines.append(f"| {probe['name']} | {probe['shape']} | {probe['tokens']:,} | {'on' if probe['kl'] else 'off'} | "
                     f"{gb['cuda_peak_mb']} | {gb['cuda_reserved_mb']} | {gb['static_mb']} | "
                     f"{gb['step_above_static_mb']} | {probe['tokens_per_s']:,.0f} | {probe['seconds']:.2f} | {mfu} | "
                     f"{probe['loss']:.6f} |")
    lines += ["", "| probe | seconds | measured |", "| --- | --- | --- |"]
    for probe in side:
        detail = probe.get("error") or ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                                                 for key, value in probe.items() if key not in ("probe", "seconds"))
        lines.append(f"| {probe['probe']} | {probe.get('seconds', 0):.2f} | {detail} |")
    return "\n".join(lines) + "\n"


def colocated(args: argparse.Namespace) -> str:
    """bench/gpu_colocated.py in a process of its own; its report, or why it failed."""
    script = Path(__file__).resolve().parent / "gpu_colocated.py"
    try:
        done = subprocess.run([sys.executable, str(script), "--device", args.device, "--out", str(args.out)],
                              capture_output=True, text=True, timeout=args.colocated_timeout_s)
    except subprocess.TimeoutExpired:
        return f"Co-located collect -> train -> collect: timed out after {args.colocated_timeout_s:.0f} s.\n"
    report = Path(args.out) / "gpu_colocated.md"
    if done.returncode != 0 or not report.exists():
        return f"Co-located collect -> train -> collect: failed ({done.returncode}): {done.stderr[-1500:]}\n"
    return report.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda where there is one, else cpu (the proxy)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: Qwen's on CUDA, 512 on CPU)")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per probe")
    parser.add_argument("--colocated-timeout-s", type=float, default=240.0, help="the co-located run")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-check"))
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_transformers()
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = Sizes.of(args.device.startswith("cuda"), args.vocab)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.probe:  # one scorer or rollout probe, in this (fresh) process
        what, _, which = args.probe.partition(" ")  # "scorer trie", "scorer naive", "rollouts cuda", ...
        if what == "float16":
            result = float16_probe(sizes, args.device)
        else:
            result = scorer_probe(which, sizes, args.device, out) if what == "scorer" else rollouts_probe(which, out)
        print(json.dumps(result))
        return
    started = time.perf_counter()
    train = []
    for planned in train_plan(sizes):
        if planned["path"].endswith("+lora") and not has_peft():
            result = {"skipped": LORA_SKIPPED}
        else:
            result = run_probe(planned["path"], planned["tokens"], sizes.vocab, planned["shape"], args.device,
                               planned["repeat"], timeout_s=args.timeout_s, optimizer=planned["optimizer"],
                               kl=planned["kl"])
        result = {**result, **{key: planned[key] for key in ("name", "shape", "tokens", "kl")}}
        print(json.dumps(result), flush=True)
        train.append(result)
    side_names = ["scorer trie", "scorer naive", "float16 step"] + (
        ["rollouts cuda", "rollouts cpu"] if sizes.cuda else [])
    side = []
    for name in side_names:
        result = run_side_probe(name, args)
        print(json.dumps(result), flush=True)
        side.append(result)
    found = targets(sizes, {p["name"]: p for p in train}, {p["probe"]: p for p in side}, out)
    device = next((p["device"] for p in train if "device" in p), args.device)
    text = markdown(device, train, side, found)
    text += "\n" + colocated(args)
    text += f"\nWall time of the check: {time.perf_counter() - started:.0f} s\n"
    print(text)
    (out / "gpu_check.json").write_text(json.dumps(
        {"probes": train, "side": side, "targets": [t.__dict__ for t in found]}, indent=1) + "\n")
    (out / "gpu_check.md").write_text(text)
    failed = [target.name for target in found if target.holds is False]
    if failed:
        sys.exit(f"error: gpu check: {len(failed)} target(s) do not hold: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
