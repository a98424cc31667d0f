"""Continuous batching for the torch backend: requests join and leave a running decode batch
(docs/architecture.md §6).

Design decisions:
- A `DecodeBatch` holds the rows decoding together: one KV cache per layer left-padded to a common
  width W ((B, H, W, D) tensors), a 2-D attention mask (B, W), each row's next position (B, 1) and
  its next-token logits (B, V). New requests are prefilled together (one left-padded forward) and
  joined to the batch by padding the narrower cache on the left; a row that ends leaves at once
  (its row of the cache is dropped), and columns that are padding in every remaining row are cut.
  Every forward passes explicit position ids, so padding never moves a row's positions.
- Each row samples from its own CPU generator, one uniform per token (inverse CDF), so the tokens a
  row draws depend on its seed and its logits only, never on its neighbours' randomness. The floats
  of a batched forward do depend on the batch's shape in the last bits (this backend is not
  batch-invariant: measured up to ~3e-6 in a log-prob on the tiny policy), so a token can differ
  between two batchings only where its uniform falls that close to a CDF boundary.
- `run_to_end` is the batch API's engine: every request admitted at once, stepped until all end, in
  the caller's thread. `DecodeServer` runs a batch on a thread of its own and takes requests from
  any thread at any time: each step first admits what is waiting (within `max_rows` rows and
  `max_tokens` padded cache positions), then samples one token for every row, so a request waits at
  most one step to join. Other work on the model (the IS gate's scoring) runs on that thread
  between steps, so two forwards never share the model at once.
- A forward that raises fails every row of its batch (they share the forward), and only them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cleaner.engine.model.base import LENGTH, STOP, Generation, SamplingParams
from cleaner.engine.model.kv import KV, causal_forward, kv_select

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 256  # rows decoding at once (SGLang's max_running_requests plays this part)
DEFAULT_MAX_TOKENS = 262_144  # rows x padded width of the cache: 256 rows of 1,024 positions


# ---------------------------------------------------------------------------- sampling


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a row is sampled from. logits (B, V) -> (B, V) float32.

    temperature 0 returns the raw log-softmax (greedy reports its token's untempered log-prob).
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if temperature > 0 and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        outside = mass_before >= top_p  # the first token is always kept
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.log_softmax(dim=-1)


def draw_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. logprobs (B, V), uniforms (B,) in [0, 1) -> token ids (B,)."""
    cdf = logprobs.exp().cumsum(dim=-1)  # (B, V)
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # (B,)
    return tokens.clamp(max=cdf.shape[-1] - 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Left-padded ids (B, T), attention mask (B, T) and position ids (B, T)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


# ---------------------------------------------------------------------------- requests


@dataclass(eq=False)
class DecodeRequest:
    """One generation: its prompt, params, seed, and where its result goes."""

    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    done: Callable[[Generation | BaseException], None]  # called once, with the result or the error
    cancelled: Callable[[], bool] = lambda: False  # a request nobody waits for any more leaves
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(int(self.seed))

    def finish(self, reason: str) -> None:
        self.done(Generation(tuple(self.token_ids), tuple(self.logprobs), reason))


# ---------------------------------------------------------------------------- the batch


class DecodeBatch:
    """Rows decoding together on one model; see the module's notes."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[DecodeRequest] = []
        self.kv: KV = ()
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # (B, W), 1 = real token
        self.next_positions = torch.zeros((0, 1), dtype=torch.long, device=device)  # (B, 1)
        self.logits: torch.Tensor | None = None  # (B, V): each row's next-token distribution

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def cost_with(self, prompt_len: int, extra_rows: int = 1) -> int:
        """Padded cache positions once `extra_rows` more rows of `prompt_len` tokens have joined."""
        return (len(self.rows) + extra_rows) * max(self.width, prompt_len)

    @torch.inference_mode()
    def admit(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill `requests` in one forward and join them to the batch."""
        ready = []
        for request in requests:
            if request.params.max_new_tokens <= 0:
                request.finish(LENGTH)
            else:
                ready.append(request)
        if not ready:
            return
        input_ids, mask, positions = left_pad([r.prompt for r in ready], self.pad_id, self.device)
        out = causal_forward(self.model, input_ids, mask, positions, logits_to_keep=1)
        self._join(ready, out.kv, mask, positions[:, -1:] + 1, out.logits[:, -1])

    def _join(self, rows: list[DecodeRequest], kv: KV, mask: torch.Tensor, next_positions: torch.Tensor,
              logits: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.kv, self.mask, self.next_positions, self.logits = rows, kv, mask, next_positions, logits
            return
        width = max(self.width, mask.shape[1])
        self.kv = tuple((torch.cat([_pad_left(ko, width), _pad_left(kn, width)]),
                         torch.cat([_pad_left(vo, width), _pad_left(vn, width)]))
                        for (ko, vo), (kn, vn) in zip(self.kv, kv, strict=True))
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(mask, (width - mask.shape[1], 0))])
        self.next_positions = torch.cat([self.next_positions, next_positions])
        self.logits = torch.cat([self.logits, logits])
        self.rows = self.rows + rows

    @torch.inference_mode()
    def step(self) -> None:
        """Sample one token for every row; rows that end leave, the rest move one position on."""
        if not self.rows:
            return
        tokens, logprobs = sample_rows(self.logits, self.rows)
        keep = []
        for index, (row, token, logprob) in enumerate(zip(self.rows, tokens, logprobs, strict=True)):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if token in row.params.stop_token_ids:
                row.finish(STOP)
            elif len(row.token_ids) >= row.params.max_new_tokens:
                row.finish(LENGTH)
            elif not row.cancelled():
                keep.append(index)
        if not keep:
            self.clear()
            return
        if len(keep) < len(self.rows):
            rows = torch.tensor(keep, device=self.device)
            self.kv, self.mask = kv_select(self.kv, rows), self.mask[rows]
            self.next_positions = self.next_positions[rows]
            self.rows = [self.rows[index] for index in keep]
        next_tokens = torch.tensor([self.rows[i].token_ids[-1] for i in range(len(self.rows))],
                                   device=self.device).unsqueeze(-1)  # (B, 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        out = causal_forward(self.model, next_tokens, self.mask, self.next_positions, past=self.kv)
        self.kv, self.logits = out.kv, out.logits[:, -1]
        self.next_positions = self.next_positions + 1
        self._trim()

    def _trim(self) -> None:
        """Cut the leading columns that are padding in every row."""
        used = self.mask.any(dim=0)  # (W,)
        first = int(used.int().argmax())
        if first > 0:
            self.kv = tuple((keys[:, :, first:], values[:, :, first:]) for keys, values in self.kv)
            self.mask = self.mask[:, first:]

    def fail(self, error: BaseException) -> None:
        """Every row ends with `error`."""
        for row in self.rows:
            row.done(error)
        self.clear()

    def clear(self) -> None:
        self.rows, self.kv, self.logits = [], (), None
        self.mask = self.mask[:0, :0]
        self.next_positions = self.next_positions[:0]


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, W0, D) -> (B, H, width, D), zeros before."""
    return F.pad(tensor, (0, 0, width - tensor.shape[2], 0))


def sample_rows(logits: torch.Tensor, rows: Sequence[DecodeRequest]) -> tuple[list[int], list[float]]:
    """Each row's next token (from its own generator) and its behaviour log-prob; rows are sampled in
    groups of equal (temperature, top_p). logits (B, V)."""
    groups: dict[tuple[float, float], list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault((row.params.temperature, row.params.top_p), []).append(index)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    picked = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
    for (temperature, top_p), indices in groups.items():
        index = torch.tensor(indices, device=logits.device) if len(indices) < len(rows) else slice(None)
        group_logits = logits[index]
        logprobs = sampling_logprobs(group_logits, temperature, top_p)  # (G, V)
        if temperature == 0:
            drawn = group_logits.argmax(dim=-1)
        else:
            uniforms = torch.cat([torch.rand(1, generator=rows[i].generator) for i in indices])  # (G,)
            drawn = draw_tokens(logprobs, uniforms)
        tokens[index] = drawn
        picked[index] = logprobs.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), picked.tolist()  # one device sync


def run_to_end(batch: DecodeBatch, requests: Sequence[DecodeRequest]) -> None:
    """Admit every request at once and step until all have ended (the batch API)."""
    batch.admit(requests)
    while batch.rows:
        batch.step()


# ---------------------------------------------------------------------------- the decoding thread


@dataclass(frozen=True)
class _Call:
    """Work on the model run between two steps; its result goes to `future`."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


_STOP = object()


class DecodeServer:
    """A decode batch on a thread of its own, fed from any thread (module notes)."""

    def __init__(self, new_batch: Callable[[], DecodeBatch], max_rows: int = DEFAULT_MAX_ROWS,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_rows < 1 or max_tokens < 1:
            raise ValueError(f"max_rows and max_tokens must be >= 1, got {max_rows}, {max_tokens}")
        self.new_batch, self.max_rows, self.max_tokens = new_batch, max_rows, max_tokens
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.steps = 0  # decode steps taken (one token for every row of the batch)
        self.rows_stepped = 0  # sum over steps of the rows in the batch: mean batch = rows / steps

    def submit(self, request: DecodeRequest) -> None:
        self._ensure_running()
        self._inbox.put(request)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the decoding thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._ensure_running()
        self._inbox.put(_Call(fn, future))
        return future

    def close(self) -> None:
        """End the thread; requests still waiting or running fail."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._inbox.put(_STOP)
            thread.join()

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="torch-decode", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        batch, waiting = self.new_batch(), deque()
        while True:
            stop = self._take(block=not batch.rows and not waiting, waiting=waiting)
            if stop:
                error = RuntimeError("the torch backend was closed")
                batch.fail(error)
                for request in waiting:
                    request.done(error)
                return
            if not batch.rows:
                batch = self.new_batch()  # picks up weights adopted since the last batch
            admitted = self._admissible(batch, waiting)
            try:
                batch.admit(admitted)
                self.steps += bool(batch.rows)
                self.rows_stepped += len(batch.rows)
                batch.step()
            except Exception as error:  # every row of this batch shared the forward that failed
                log.exception("torch decode step failed; its %d requests end with the error", len(batch.rows))
                for request in admitted:
                    if request not in batch.rows:
                        request.done(error)
                batch.fail(error)

    def _take(self, block: bool, waiting: deque) -> bool:
        """Move what the inbox holds to `waiting` (requests) or run it (calls); True to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return False
            block = False
            if item is _STOP:
                return True
            if isinstance(item, _Call):
                _run_call(item)
            elif not item.cancelled():
                waiting.append(item)

    def _admissible(self, batch: DecodeBatch, waiting: deque) -> list[DecodeRequest]:
        """The waiting requests that fit now, oldest first (one always, into an empty batch)."""
        admitted: list[DecodeRequest] = []
        while waiting and len(batch.rows) + len(admitted) < self.max_rows:
            longest = max([len(waiting[0].prompt)] + [len(r.prompt) for r in admitted])
            if (batch.rows or admitted) and batch.cost_with(longest, len(admitted) + 1) > self.max_tokens:
                break
            admitted.append(waiting.popleft())
        return admitted


def _run_call(call: _Call) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn())
    except BaseException as error:  # handed to the caller, who raises it
        call.future.set_exception(error)
