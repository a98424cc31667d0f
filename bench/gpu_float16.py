"""float16, the paper's compute dtype, on the device (a probe of `make gpu-check`, bench/gpu_check.py).

On a Qwen3-0.6B-shaped random model (the CPU proxy's shape where there is no CUDA) and four rows
of a few thousand tokens in all, shaped as the warehouse's (a prompt, a tool span with loss_mask 0
inside the response, old and behaviour log-probs the model's own), through the trainer itself
(`train_iteration`, mini batches of two rows: two optimiser steps):
1. float16 against float32 from the same weights: each step's loss and gradient norm (the norm
   logged after unscaling, so the true one);
2. a forced overflow (the GradScaler's scale set where any float16 gradient is infinite): the step
   is skipped (its grad norm non-finite, every weight unchanged), the scale halves, the schedule
   still moves on;
3. the scale saved with the checkpoint and resumed through `load_optimization`, with verl's growth
   interval (400).
The checkpoints go to a temporary directory, removed after (each holds AdamW's moments: 8 bytes a
parameter). It needs torch and transformers only; cleaner comes from this checkout.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path


def warehouse_rows(model, tokens: int, vocab: int, device: str) -> list:
    """Four rows of tokens / 4: an eighth of prompt, then trained tokens with a tool span (loss_mask
    0) in the middle; old = behaviour = the model's own float32 log-probs, advantages +-1."""
    import torch

    from cleaner.engine.train.loss import token_log_probs
    from cleaner.records import PurifiedRow

    generator = torch.Generator().manual_seed(3)
    length = tokens // 4
    prompt, tool = max(length // 8, 1), max(length // 16, 1)
    rows = []
    for index in range(4):
        ids = torch.randint(1, vocab, (length,), generator=generator)
        mask = [0] * prompt + [1] * length
        middle = prompt + (length - prompt) // 2
        mask[middle:middle + tool] = [0] * tool
        mask = mask[:length]
        with torch.no_grad():
            log_probs = token_log_probs(model(input_ids=ids[None].to(device)).logits.float(), ids[None].to(device))[0]
        old = tuple(lp if m else 0.0 for lp, m in zip(log_probs.tolist(), mask, strict=True))
        rows.append(PurifiedRow(
            config_id="gpu", iteration=0, rollout_id=f"r{index}", group_id=f"g{index // 2}",
            token_ids=tuple(ids.tolist()), prompt_len=prompt, loss_mask=tuple(mask), behavior_logprobs=old,
            old_logprobs=old, reward=float(index % 2), advantage=1.0 - 2 * (index % 2), rolled_back=False,
            n_shallow=0, n_deep=0, n_unrecovered=0, tokens_removed=0, scorer_version="gpu"))
    return rows


def probe(model, tokens: int, vocab: int, device: str) -> dict:
    """The three checks above on `model` (float32, on `device`); the measured values."""
    import torch

    from cleaner.config import TrainConfig
    from cleaner.engine.train.optim import load_optimization
    from cleaner.engine.train.trainer import train_iteration

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu-float16-"))
    try:
        (work / "policy").mkdir()  # no tokenizer, no optimiser state: the model is passed in
        rows = warehouse_rows(model, tokens, vocab, device)
        base = TrainConfig(lr=1e-5, mini_batch_size=2, micro_batch_size=1, device=device, save_dtype="float32",
                           gradient_checkpointing=device.startswith("cuda"))
        fp16_config = dataclasses.replace(base, compute_dtype="float16")
        fp16_model = copy.deepcopy(model)
        fp32 = train_iteration(rows, work / "policy", work / "fp32", dataclasses.replace(base, compute_dtype="float32"),
                               0, model=model, progress=False)
        shutil.rmtree(fp32.out_path)
        fp16 = train_iteration(rows, work / "policy", work / "fp16", fp16_config, 0, model=fp16_model, progress=False)
        optimization = fp16.optimization
        growth_interval = optimization.scaler.state_dict()["growth_interval"]
        optimization.scaler.update(65504.0 * 2**10)  # any float16 gradient overflows at this scale
        scale, step = optimization.scaler.get_scale(), optimization.step
        before = [p.detach().clone() for p in fp16.model.parameters()]
        skipped = train_iteration(rows[:2], fp16.out_path, work / "overflow", fp16_config, 1, model=fp16.model,
                                  optimization=optimization, progress=False)
        unchanged = all(torch.equal(p, q) for p, q in zip(fp16.model.parameters(), before, strict=True))
        del before
        resumed = load_optimization(fp16.model, fp16_config, skipped.out_path)
        return {"probe": "float16 step", "seconds": time.perf_counter() - started, "tokens": tokens,
                "fp32_losses": [s.loss for s in fp32.steps], "fp16_losses": [s.loss for s in fp16.steps],
                "fp32_grad_norms": [s.grad_norm for s in fp32.steps],
                "fp16_grad_norms": [s.grad_norm for s in fp16.steps],
                "overflow_grad_norm": str(skipped.steps[0].grad_norm),
                "overflow_skipped": not math.isfinite(skipped.steps[0].grad_norm) and unchanged,
                "scale_halved": optimization.scaler.get_scale() == scale / 2,
                "schedule_moved": optimization.step == step + 1 and skipped.steps[0].optimizer_step == step,
                "scale_resumed": resumed.scaler.state_dict() == optimization.scaler.state_dict(),
                "resumed_scale": resumed.scaler.get_scale(), "growth_interval": growth_interval}
    finally:
        shutil.rmtree(work, ignore_errors=True)
