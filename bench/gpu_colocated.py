"""Co-located on one GPU: collect -> train -> collect with the SGLang engine in the trainer's process
(part of `make gpu-check`; docs/running.md, "One GPU: the engine and the trainer take turns").

`cleaner run` for two iterations of the toy on a Qwen3-0.6B-shaped random model (the tiny policy's
tokenizer and vocabulary, so that what it samples decodes), the SGLang engine on `--device` with its
memory saver, training in bfloat16 on the same GPU: the engine releases its memory for the train step
and resumes it after (cleaner/loop/iterations.py, `_engine_aside`). Reports, per phase, the peak of
the GPU's used memory (all processes: the engine's scheduler runs in a process of its own), the
trainer process's own peak, and each collection's generated tokens per second.

It needs the whole of cleaner (duckdb, polars) and sglang with CUDA; where either is missing it says
so in one line and writes that as its report, so `make gpu-check` still answers the rest.
Like the other probes it runs from a python that does not have cleaner installed (the device
image's): it puts this checkout on its own path, and on PYTHONPATH for the processes it starts.

    python bench/gpu_colocated.py --out runs/gpu-check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, CHECKOUT)  # cleaner from this checkout, installed or not

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}


def missing(device: str) -> str | None:
    """Why the check cannot run here, or None."""
    needed = ("sglang", "duckdb", "polars") if device.startswith("cuda") else ("duckdb", "polars")
    absent = [name for name in needed if not _imports(name)]
    if absent:
        return f"{', '.join(absent)} not installed here (the co-located check needs `pip install 'cleaner[sglang]'`)"
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return "no CUDA device visible"
    return None


def _imports(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    if name == "sglang":  # importing it picks its platform; finding it is enough
        return True
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


class MemoryWatch:
    """The GPU's used memory (every process), sampled every 50 ms, its peak per phase."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, device
        self.phase, self.peaks, self.trainer = "start", {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.device.startswith("cuda"):
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def leave(self) -> None:
        if self.device.startswith("cuda"):
            self.trainer[self.phase] = max(self.trainer.get(self.phase, 0),
                                           self.torch.cuda.max_memory_allocated(self.device))

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            if not self.device.startswith("cuda"):
                continue
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), total - free)


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    import cleaner.loop.iterations as iterations
    from cleaner.config import DEFAULT_POLICY, CollectConfig, PurifyConfig, RunConfig, TrainConfig
    from cleaner.warehouse import Warehouse

    work = Path(tempfile.mkdtemp(prefix="gpu-colocated-"))
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
    torch.manual_seed(0)
    shape = QWEN3_06B if args.shape == "qwen3-0.6b" else {"hidden_size": 64, "intermediate_size": 128,
                                                          "num_hidden_layers": 2, "num_attention_heads": 2,
                                                          "num_key_value_heads": 1, "head_dim": 32}
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=4096,
                                         pad_token_id=tokenizer.pad_token_id, **shape))
    model.save_pretrained(work / "policy")
    tokenizer.save_pretrained(work / "policy")
    del model
    backend = "sglang" if args.device.startswith("cuda") else "torch"
    config = RunConfig(run_dir=str(work / "run"), iterations=2,
                       collect=CollectConfig(model=str(work / "policy"), n_prompts=args.prompts, group_size=8,
                                             max_new_tokens=256, max_response_tokens=1024, backend=backend,
                                             device=args.device),
                       purify=PurifyConfig(),
                       train=TrainConfig(lr=1e-5, mini_batch_size=64, micro_batch_size=8, device=args.device,
                                         compute_dtype="bfloat16" if backend == "sglang" else "float32",
                                         gradient_checkpointing=True))
    calls = dict.fromkeys(("collect_job", "purify_job", "train_job"), 0)
    with MemoryWatch(args.device) as watch:
        for name in calls:
            original = getattr(iterations, name)

            def phase(*a, _original=original, _name=name, **k):
                watch.enter(f"{_name.split('_')[0]} {calls[_name]}")
                calls[_name] += 1
                try:
                    return _original(*a, **k)
                finally:
                    watch.leave()  # the trainer process's peak of the phase

            setattr(iterations, name, phase)
        started = time.perf_counter()
        rows = iterations.run_loop(config, progress=False)
        seconds = time.perf_counter() - started
    warehouse = Warehouse(work / "run" / "warehouse")
    generated = dict(warehouse.connect().sql(
        "SELECT r.iteration, sum(len(s.token_ids)) FROM segments s JOIN rollouts r USING (rollout_id) "
        "WHERE s.kind = 'assistant' GROUP BY 1").fetchall())
    collects = [{"iteration": row.iteration, "seconds": row.collect_s, "tokens": int(generated[row.iteration]),
                 "tokens_per_s": generated[row.iteration] / row.collect_s} for row in rows]
    return {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "backend": backend, "shape": args.shape, "seconds": seconds, "collects": collects,
            "gpu_used_peak_mb": {k: v / 2**20 for k, v in watch.peaks.items()},
            "trainer_peak_mb": {k: v / 2**20 for k, v in watch.trainer.items()}}


def markdown(report: dict) -> str:
    if "skipped" in report:
        return f"Co-located collect -> train -> collect: skipped: {report['skipped']}.\n"
    lines = [f"Co-located collect -> train -> collect on {report['device']} ({report['backend']} engine, "
             f"{report['shape']} shape, {report['seconds']:.0f} s):", "",
             "| phase | GPU used, peak GB (all processes) | trainer process, peak GB |", "| --- | --- | --- |"]
    for phase, used in report["gpu_used_peak_mb"].items():
        lines.append(f"| {phase} | {used / 1024:.2f} | {report['trainer_peak_mb'].get(phase, 0) / 1024:.2f} |")
    lines += ["", "| collect of iteration | seconds | generated tokens | tokens/s |", "| --- | --- | --- | --- |"]
    for c in report["collects"]:
        lines.append(f"| {c['iteration']} | {c['seconds']:.1f} | {c['tokens']:,} | {c['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=("qwen3-0.6b", "small"), default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-check"))
    args = parser.parse_args(argv)
    # the processes the loop starts (the sandbox's workers, the grading workers) find the same cleaner
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (CHECKOUT, os.environ.get("PYTHONPATH"))))
    why = missing(args.device)
    report = {"skipped": why} if why else run(args)
    text = markdown(report)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_colocated.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_colocated.md").write_text(text)
    return report


if __name__ == "__main__":
    main()
