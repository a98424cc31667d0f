"""The Backend protocol on an in-process `sglang.Engine`: one node's GPUs, or this machine's CPU.

Run on CPU with SGLang 0.5.23 (`make sglang-cpu`, `make test-sglang`: the contract suite, purify
against the torch scorer, collect and purify from the CLI). The CUDA path (deterministic inference,
`base_gpu_id`, the checkpoint's own dtype) is written against the same API and has not run here
(docs/architecture.md §6).

Design decisions:
- The engine starts with `skip_tokenizer_init=True` (requests are token ids; sglang_wire.py has
  the request and response shapes); the tokenizer for the chat format is loaded here with
  transformers from the same checkpoint.
- `device` is `cpu`, `cuda` or `cuda:N` (`base_gpu_id=N`). On `cpu`, cleaner sets what SGLang's
  CPU path needs itself: `SGLANG_USE_CPU_ENGINE=1` before sglang is imported (SGLang chooses its
  platform from it on import; without it the model build looks for GPU kernels), and the options that
  work there (`CPU_ENGINE_OPTIONS`: PyTorch-native attention and sampling, no CUDA graphs, no
  overlap schedule, a fixed KV budget because the automatic memory fraction resolves to a negative
  number on a small machine, float32). Options passed as keyword arguments win.
- Seeds. On a GPU, deterministic inference (`deterministic=True`, the default; docs/running.md says
  why) makes SGLang honour per-request seeds with batch-invariant kernels, so a rollout is the same
  whatever ran beside it and a resumed or sharded collection writes what one uninterrupted run
  writes. `deterministic=False` trades that for SGLang's faster kernels. Deterministic inference
  refuses PyTorch-native attention, so on CPU it is off and per-request seeds are ignored; the
  engine's `random_seed` (`seed`) then makes a run reproducible only where the requests arrive in
  the same order (lock step), and greedy decoding is deterministic.
- One `Engine.generate` call per `generate` or `score`, with per-request lists: the engine batches
  them itself. The agent loop's requests go through `Engine.async_generate` on the engine's own
  event loop (`event_loop`), where SGLang's tokenizer manager receives its results: each rollout
  awaits its own request and the engine's scheduler batches whatever is running.
- Memory (`release_memory`, `resume_memory`): on a GPU the engine starts with SGLang's memory saver
  (`enable_memory_saver`, which needs the `torch_memory_saver` package), so `cleaner run` on one
  GPU hands the weights' and KV cache's memory to the trainer and takes it back after
  (`release_memory_occupation` / `resume_memory_occupation`); `adopt` then loads the new weights
  into the resumed memory. `mem_fraction_static` (None: SGLang's default) is the share of the
  GPU the engine takes for weights and KV cache while it serves. Purify's scorer is `BackendScorer` over `score`: one request per radix-tree edge,
  so RadixAttention holds the shared paths (backend_scorer.py); `tokens_computed` counts what the
  engine says it computed (prompt tokens minus `cached_tokens`).
- New weights: `update_weights_from_disk(path)`, which waits for running requests and flushes the
  radix cache, so no KV computed with the old weights is reused. When the scheduler has not yet
  retired the last batch, SGLang loads the weights but refuses the flush; a flush that waits for
  idle then completes it (`weights_in_cache_kept` in sglang_wire.py).
- Closing: SGLang's `Engine.shutdown` SIGKILLs every child process of this process (the resource
  tracker of multiprocessing included) and is registered to run again at exit. `close` removes
  that registration and restarts the tracker; close the engine after anything else this process
  started (the jobs close it after the sandbox).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from cleaner.engine.model.base import SGLANG_INSTALL_HINT, BackendError
from cleaner.engine.model.sglang_common import SGLangRequests
from cleaner.engine.model.sglang_wire import (
    FLUSH_WAIT_S,
    EngineError,
    batch_body,
    responses_of,
    weights_in_cache_kept,
)

log = logging.getLogger(__name__)

# What SGLang's CPU path needs (measured with SGLang 0.5.23 on a 2-core x86 machine).
CPU_ENGINE_OPTIONS: dict[str, Any] = {
    "attention_backend": "torch_native",  # the CUDA backends' kernels do not exist on CPU
    "sampling_backend": "pytorch",  # flashinfer's sampling kernels neither
    "grammar_backend": "none",  # constrained decoding is never asked for
    "disable_cuda_graph": True,
    "disable_overlap_schedule": True,  # overlapping needs CUDA streams
    "mem_fraction_static": 0.05,  # left automatic it resolves to a negative fraction on small hosts
    "max_total_tokens": 8192,  # the KV budget, in tokens; requests beyond it wait their turn
    "max_running_requests": 8,
    "chunked_prefill_size": -1,  # one prefill per request: purify's rows are short
    "sleep_on_idle": True,  # an idle scheduler otherwise polls at ~30% of a core
    "log_level": "error",  # without CPU kernels SGLang warns about each model class it cannot import
}
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"  # SGLang treats the host as its device only with this = 1


def engine_device(device: str) -> tuple[str, int]:
    """`cpu` -> ("cpu", 0), `cuda` -> ("cuda", 0), `cuda:N` -> ("cuda", N); else a BackendError."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu" and not index:
        return "cpu", 0
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index or 0)
    raise BackendError(f"device {device!r}: the sglang engine runs on cpu, cuda or cuda:N; "
                       "pass --sglang-url for a running server")


def engine_options(device: str, dtype: str | None, seed: int, overrides: dict[str, Any], *,
                   deterministic: bool = True, mem_fraction: float | None = None) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine` (besides model_path) for `device`."""
    kind, index = engine_device(device)
    options: dict[str, Any] = {"skip_tokenizer_init": True, "random_seed": int(seed), "log_level": "warning"}
    if kind == "cpu":
        options.update(CPU_ENGINE_OPTIONS, device="cpu", dtype=dtype or "float32",
                       enable_deterministic_inference=False)
    else:
        options.update(base_gpu_id=index, dtype=dtype or "auto", enable_deterministic_inference=deterministic,
                       enable_memory_saver=True)
        if mem_fraction is not None:
            options["mem_fraction_static"] = mem_fraction
    options.update(overrides)
    return options


def import_sglang(device: str = "cuda"):
    """The sglang module, imported for `device`, or a BackendError saying how to install it."""
    if engine_device(device)[0] == "cpu" and os.environ.get(CPU_ENGINE_ENV) != "1":
        if _device_already_chosen():
            raise BackendError(f"sglang was imported before {CPU_ENGINE_ENV}=1 was set, so it cannot "
                               "run on cpu in this process; set it before importing sglang")
        os.environ[CPU_ENGINE_ENV] = "1"  # read on first use; inherited by the engine's processes
    try:
        import sglang  # optional extra
    except ImportError as error:
        raise BackendError(f"the sglang backend needs SGLang, which is not installed here ({error}); "
                           f"install it with: {SGLANG_INSTALL_HINT}") from error
    return sglang


def _device_already_chosen() -> bool:
    """Has sglang, imported in this process already, chosen a device other than the CPU?
    (`import sglang` resolves its platform once, from SGLANG_USE_CPU_ENGINE.)"""
    platforms = sys.modules.get("sglang.srt.platforms")
    platform = getattr(platforms, "_current_platform", None)
    return platform is not None and getattr(platform, "device_name", None) != "cpu"


def restore_resource_tracker() -> None:
    """Start multiprocessing's resource tracker again and register the live named semaphores and
    shared memory with it, as the one SGLang's `Engine.shutdown` killed (with every other child of
    this process) had them. Without this, each later release of one (tqdm's lock at exit) revives
    a tracker that never saw it, which prints a KeyError traceback."""
    from multiprocessing import resource_tracker, shared_memory, synchronize  # (only at close)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resource_tracker: process died unexpectedly": we know why
        resource_tracker.ensure_running()
    for thing in gc.get_objects():  # type(), not isinstance(): no lazy attribute of any module runs
        if issubclass(type(thing), synchronize.SemLock) and thing._semlock.name is not None:
            resource_tracker.register(thing._semlock.name, "semaphore")
        elif issubclass(type(thing), shared_memory.SharedMemory):
            resource_tracker.register(thing._name, "shared_memory")


class SGLangBackend(SGLangRequests):
    """Generation and scoring on an in-process `sglang.Engine`."""

    def __init__(self, model_path: str | Path, device: str = "cuda", dtype: str | None = None,
                 seed: int = 0, *, deterministic: bool = True, mem_fraction: float | None = None,
                 **engine_kwargs: Any) -> None:
        options = engine_options(device, dtype, seed, engine_kwargs, deterministic=deterministic,
                                 mem_fraction=mem_fraction)  # a bad device fails first
        self.memory_saver = bool(options.get("enable_memory_saver"))
        self.device = engine_device(device)
        sglang = import_sglang(device)
        self._read_checkpoint(model_path)
        logging.getLogger("sglang").setLevel(options["log_level"].upper())  # its loggers in this process
        self.engine = sglang.Engine(model_path=str(model_path), **options)
        self._serve(model_path)

    def adopt(self, model_path: str | Path) -> None:
        """Load the weights saved at `model_path` (same architecture) into the running engine."""
        success, message, *_ = self.engine.update_weights_from_disk(str(model_path))
        if not success and weights_in_cache_kept(message):
            flushed = self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.flush_cache(timeout_s=FLUSH_WAIT_S))
            success, message = flushed.success, flushed.message or message
        if not success:
            raise EngineError(f"sglang could not load weights from {model_path}: {message}")
        self._serve(model_path)
        log.info("sglang engine now serves %s as %s", model_path, self._policy_version)

    @property
    def event_loop(self):
        """SGLang's tokenizer manager receives results on the loop the engine was started with."""
        return self.engine.loop

    def occupies(self, device: str) -> bool:
        """On a GPU with the memory saver: the engine holds memory on its GPU (`device` the same GPU)."""
        kind, index = self.device
        return self.memory_saver and kind == "cuda" and str(device).startswith("cuda") and \
            engine_device(str(device))[1] == index

    def release_memory(self) -> None:
        """Free the weights' and the KV cache's GPU memory (memory saver); a no-op without it."""
        if self.memory_saver:
            self.engine.release_memory_occupation()
            log.info("sglang engine released its GPU memory")

    def resume_memory(self) -> None:
        """Take the memory back; the weights in it are stale until `adopt` loads a checkpoint."""
        if self.memory_saver:
            self.engine.resume_memory_occupation()
            log.info("sglang engine resumed its GPU memory")

    def close(self) -> None:
        self.engine.shutdown()  # SIGKILLs every child process of this process (SGLang's way) ...
        atexit.unregister(self.engine.shutdown)  # ... and would again at exit, registered at start
        multiprocessing.active_children()  # reaps the engine's processes
        restore_resource_tracker()

    def _send(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One batch to the engine."""
        return responses_of(self.engine.generate(**batch_body(bodies)), len(bodies)) if bodies else []

    async def _send_async(self, bodies: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
        """One batch, awaited on the engine's loop (one engine: no server to choose)."""
        if not bodies:
            return []
        return responses_of(await self.engine.async_generate(**batch_body(bodies)), len(bodies))
