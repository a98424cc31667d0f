"""Supervised training of the tiny default policy (docs/architecture.md §11).

Design decisions:
- The model is a Qwen3ForCausalLM (hidden 128, 2 layers, 4 heads of 32, 2 KV heads, MLP 384, tied
  embeddings, ~0.46M parameters, 1024 positions), so every backend treats it like a real Qwen3.
- Trajectories are tokenised segment by segment exactly as the agent loop builds them: the prompt
  through `ChatFormat.prompt_ids` (chat template + generation prompt), each assistant and tool
  segment encoded on its own. Only assistant tokens are trained (loss_mask 1), including the
  `</tool_call>` / `<|im_end|>` that ends each turn.
- Loss: the SUMMED masked cross-entropy of a batch divided by a CONSTANT (batch_size times the
  corpus' mean trained tokens per sequence). A per-batch token mean with length-bucketed batches
  gives each token of a long (failure + retry) batch less weight than a token of a short one, and
  the model under-learns the error trajectories.
- Batches are length-bucketed and right-padded; with a causal model and right padding no attention
  mask is needed (pad positions only see real tokens and are never trained).
- Saves are atomic: save_pretrained into a temporary sibling directory, then rename into place.
- Calibration stage (`init_from`): continue a trained policy, with its tokenizer, on a corpus with
  another failure mix at a low learning rate. The share of failing first calls the model samples
  drifts during the first stage, so a committed policy is a chosen stage-1 checkpoint plus a short
  calibration (the rates that chose it: docs/experiments.md; bench/calibrate_policy.py).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.train.checkpoint import save_checkpoint_atomic
from cleaner.outputs import CHECKPOINT, check_replaceable
from cleaner.toys.corpus import CorpusConfig, CorpusExample, build_corpus
from cleaner.toys.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)  # the synthetic corpus
    steps: int = 2500  # optimiser steps
    batch_size: int = 32  # sequences per step
    lr: float = 3e-3  # AdamW peak learning rate
    warmup_steps: int = 100  # linear warmup, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1  # floor of the cosine schedule
    weight_decay: float = 0.01  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping
    seed: int = 0  # model init and batch order
    threads: int = 2  # torch CPU threads
    log_every: int = 50  # steps between loss log lines
    checkpoint_every: int = 0  # steps between intermediate saves to <out>-checkpoints/step-N; 0 = off
    init_from: str | None = None  # continue from this policy dir (its tokenizer too): calibration stage

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class EncodedExample:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 = assistant token that is trained


@dataclass(frozen=True)
class BootstrapResult:
    out_dir: Path
    final_loss: float  # mean loss over the last log window
    tokens_seen: int
    wall_s: float


# ---------------------------------------------------------------------------------------------
# Model and data


def tiny_model(tokenizer, seed: int):
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=1024,
        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def encode_example(example: CorpusExample, chat: ChatFormat) -> EncodedExample:
    token_ids = list(chat.prompt_ids(example.task.messages))
    loss_mask = [0] * len(token_ids)
    tool_texts = example.tool_texts + ("",)
    for assistant_text, tool_text in zip(example.assistant_texts, tool_texts, strict=True):
        assistant_ids = chat.encode(assistant_text)
        token_ids += assistant_ids
        loss_mask += [1] * len(assistant_ids)
        if tool_text:
            tool_ids = chat.encode(tool_text)
            token_ids += tool_ids
            loss_mask += [0] * len(tool_ids)
    return EncodedExample(tuple(token_ids), tuple(loss_mask))


def corpus_texts(examples: list[CorpusExample]):
    for example in examples:
        for message in example.task.messages:
            yield message["content"]
        yield from example.assistant_texts
        yield from example.tool_texts


def make_batches(encoded: list[EncodedExample], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of example indices, in shuffled order."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    chunk = batch_size * 50
    batches = []
    for start in range(0, len(order), chunk):
        block = sorted(order[start:start + chunk], key=lambda i: len(encoded[i].token_ids))
        batches += [block[i:i + batch_size] for i in range(0, len(block), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(encoded: list[EncodedExample], indices: list[int], pad_id: int):
    length = max(len(encoded[i].token_ids) for i in indices)
    input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((len(indices), length), dtype=torch.float32)  # (B, T)
    for row, i in enumerate(indices):
        n = len(encoded[i].token_ids)
        input_ids[row, :n] = torch.tensor(encoded[i].token_ids)
        loss_mask[row, :n] = torch.tensor(encoded[i].loss_mask, dtype=torch.float32)
    return input_ids, loss_mask


def summed_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over trained tokens of -log p(x_t | x_<t); logits (B, T, V), ids and mask (B, T)."""
    shift_logits = logits[:, :-1].float()  # (B, T-1, V)
    targets = input_ids[:, 1:]  # (B, T-1)
    mask = loss_mask[:, 1:]  # (B, T-1)
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view_as(targets)  # (B, T-1)
    return (nll * mask).sum()


def lr_at(step: int, config: BootstrapConfig) -> float:
    warmup_steps = max(1, min(config.warmup_steps, config.steps // 5))  # short runs: a fifth at most
    if step < warmup_steps:
        return config.lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, config.steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


# ---------------------------------------------------------------------------------------------
# Training


def _prepare(config: BootstrapConfig):
    examples = build_corpus(config.corpus)
    if config.init_from is not None:
        tokenizer = AutoTokenizer.from_pretrained(config.init_from)
    else:
        tokenizer = build_tokenizer(corpus_texts(examples))
    chat = ChatFormat(tokenizer)
    encoded = [encode_example(example, chat) for example in examples]
    longest = max(len(e.token_ids) for e in encoded)
    if longest > 1024:
        raise ValueError(f"a corpus trajectory has {longest} tokens, over the model's 1024 positions")
    return tokenizer, encoded


def bootstrap_policy(config: BootstrapConfig, out_dir: Path, progress: bool = True) -> BootstrapResult:
    """Build the corpus and tokenizer, train the tiny policy, save it to `out_dir` atomically."""
    started = time.perf_counter()
    for path in [out_dir, *_checkpoint_dirs(config, out_dir)]:  # before training: every output's place
        check_replaceable(path, CHECKPOINT)
    torch.set_num_threads(config.threads)
    tokenizer, encoded = _prepare(config)
    if config.init_from is not None:
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(config.init_from)
    else:
        model = tiny_model(tokenizer, config.seed)
    logger.info("corpus: %d trajectories, %d tokens; model: %d parameters", len(encoded),
                sum(len(e.token_ids) for e in encoded), sum(p.numel() for p in model.parameters()))
    # The constant that normalises the summed loss: mean trained tokens per sequence.
    tokens_per_sequence = sum(sum(e.loss_mask) for e in encoded) / len(encoded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    rng = random.Random(config.seed)
    batches: list[list[int]] = []
    window_loss, window_tokens, tokens_seen, last_loss = 0.0, 0, 0, float("nan")
    model.train()
    for step in tqdm(range(config.steps), desc="bootstrap", disable=not progress):
        if not batches:
            batches = make_batches(encoded, config.batch_size, rng)
        input_ids, loss_mask = collate(encoded, batches.pop(), tokenizer.pad_token_id)
        logits = model(input_ids=input_ids).logits  # (B, T, V)
        summed = summed_token_loss(logits, input_ids, loss_mask)
        (summed / (config.batch_size * tokens_per_sequence)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += summed.item()
        window_tokens += int(loss_mask.sum().item())
        tokens_seen += input_ids.numel()
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            last_loss = window_loss / max(1, window_tokens)
            logger.info("step %d/%d loss %.4f lr %.2e tokens %d (%.0f tok/s)", step + 1, config.steps,
                        last_loss, lr_at(step, config), tokens_seen,
                        tokens_seen / (time.perf_counter() - started))
            window_loss, window_tokens = 0.0, 0
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            checkpoint = _checkpoint_dir(out_dir, step + 1)
            save_checkpoint_atomic(model, tokenizer, checkpoint, {"bootstrap_config.json": _config_json(config)})
    model.eval()
    save_checkpoint_atomic(model, tokenizer, out_dir, {"bootstrap_config.json": _config_json(config)})
    return BootstrapResult(Path(out_dir), last_loss, tokens_seen, time.perf_counter() - started)


def _checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(f"{out_dir}-checkpoints") / f"step-{step}"


def _checkpoint_dirs(config: BootstrapConfig, out_dir: Path) -> list[Path]:
    """The intermediate checkpoints `--checkpoint-every` will write (not the final step's)."""
    every = config.checkpoint_every
    return [_checkpoint_dir(out_dir, step) for step in range(every, config.steps, every)] if every else []


def _config_json(config: BootstrapConfig) -> str:
    return json.dumps(asdict(config), indent=2, sort_keys=True)
