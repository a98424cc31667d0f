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
from transformers.cache_utils import Cache, DynamicLayer

from cleaner.engine.model.base import LENGTH, STOP, Generation, SamplingParams
from cleaner.engine.model.kv import KV, causal_forward

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
    settled: bool = False  # `done` has been called

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(int(self.seed))

    def finish(self, reason: str) -> None:
        self.settle(Generation(tuple(self.token_ids), tuple(self.logprobs), reason))

    def settle(self, result: Generation | BaseException) -> None:
        """Hand `result` to `done`, once; a waiter that is gone (its loop closed) is not our fault."""
        if self.settled:
            return
        self.settled = True
        try:
            self.done(result)
        except Exception as error:  # the waiter's side failed: nothing to hand the result to
            log.debug("a decode request's result had nowhere to go: %r", error)


# ---------------------------------------------------------------------------- the batch


class _BufferLayer(DynamicLayer):
    """One layer's keys and values in buffers with room to grow: a forward writes its new columns
    in place (transformers' DynamicLayer concatenates, copying the whole cache at every step)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buffer_keys, self.buffer_values, self.length = keys, values, length  # (B, H, capacity, D)
        self.is_initialized = True
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.buffer_keys.shape[2]:  # double the room
            self.buffer_keys = _widen(self.buffer_keys, 2 * end)
            self.buffer_values = _widen(self.buffer_values, 2 * end)
        self.buffer_keys[:, :, self.length:end] = key_states
        self.buffer_values[:, :, self.length:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def _views(self) -> None:
        self.keys = self.buffer_keys[:, :, :self.length]
        self.values = self.buffer_values[:, :, :self.length]


def _widen(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    """`buffer` (B, H, W, D) copied into a buffer of `capacity` columns (the new ones zero)."""
    wider = buffer.new_zeros((*buffer.shape[:2], capacity, buffer.shape[3]))
    wider[:, :, :buffer.shape[2]] = buffer
    return wider


HEADROOM = 128  # columns a rebuilt cache has free for the steps to come before it must grow


class DecodeBatch:
    """Rows decoding together on one model; see the module's notes.

    The cache's columns are right-aligned: every row's latest position is the last used column, a
    row of n tokens uses the last n columns, the rest of its row is padding (mask 0). A row that
    ends is only marked (`rows[i] is None`) and keeps its place until a quarter of the rows are
    marked or new rows join; then the cache is rebuilt with the live rows only, cut to the columns
    they use."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[DecodeRequest | None] = []  # None: a row that ended, still in the cache
        self.layers: list[_BufferLayer] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # (B, W), 1 = real token
        self.next_positions = torch.zeros((0, 1), dtype=torch.long, device=device)  # (B, 1)
        self.logits: torch.Tensor | None = None  # (B, V): each row's next-token distribution

    @property
    def live(self) -> list[DecodeRequest]:
        return [row for row in self.rows if row is not None]

    @property
    def width(self) -> int:
        """Columns the live rows use (the longest live row's tokens in the cache)."""
        return max((len(row.prompt) + len(row.token_ids) for row in self.live), default=0)

    def cost_with(self, prompt_len: int, extra_rows: int = 1) -> int:
        """Padded cache positions once `extra_rows` more rows of `prompt_len` tokens have joined."""
        return (len(self.live) + extra_rows) * max(self.width, prompt_len)

    @torch.inference_mode()
    def admit(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill `requests` in one forward and join them to the batch."""
        ready = []
        for request in requests:
            if request.cancelled():
                continue
            if request.params.max_new_tokens <= 0:
                request.finish(LENGTH)
            else:
                ready.append(request)
        if not ready:
            return
        input_ids, mask, positions = left_pad([r.prompt for r in ready], self.pad_id, self.device)
        out = causal_forward(self.model, input_ids, mask, positions, logits_to_keep=1)
        self._rebuild(ready, out.kv, mask, positions[:, -1:] + 1, out.logits[:, -1])

    def _rebuild(self, new_rows: list[DecodeRequest], kv: KV, mask: torch.Tensor, next_positions: torch.Tensor,
                 logits: torch.Tensor) -> None:
        """The cache of the live rows then `new_rows` (their prefill's kv, mask, positions, logits),
        each right-aligned in the columns the longest of them needs."""
        keep = [index for index, row in enumerate(self.rows) if row is not None]
        width = max(self.width, mask.shape[1])
        old_width, new_width = self.width, mask.shape[1]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        layers = []
        for layer_index, (keys, values) in enumerate(kv):
            buffers = []
            for new, old in ((keys, "buffer_keys"), (values, "buffer_values")):
                buffer = new.new_zeros((len(keep) + len(new_rows), new.shape[1], width + HEADROOM, new.shape[3]))
                if keep:
                    used = getattr(self.layers[layer_index], old)[index, :, self.used - old_width:self.used]
                    buffer[:len(keep), :, width - old_width:width] = used
                buffer[len(keep):, :, width - new_width:width] = new
                buffers.append(buffer)
            layers.append(_BufferLayer(*buffers, width))
        rebuilt = torch.zeros((len(keep) + len(new_rows), width), dtype=torch.long, device=self.device)
        if keep:
            rebuilt[:len(keep), width - old_width:] = self.mask[index, self.used - old_width:]
        rebuilt[len(keep):, width - new_width:] = mask
        self.layers, self.mask = layers, rebuilt
        self.next_positions = torch.cat([self.next_positions[index], next_positions])
        self.logits = logits if not keep else torch.cat([self.logits[index], logits])
        self.rows = [self.rows[i] for i in keep] + list(new_rows)

    @property
    def used(self) -> int:
        """Columns of the cache in use (live and ended rows)."""
        return self.mask.shape[1]

    @torch.inference_mode()
    def step(self) -> None:
        """Sample one token for every live row; rows that end leave, the rest move one position on."""
        if not self.rows:
            return
        live = [index for index, row in enumerate(self.rows) if row is not None]
        tokens, logprobs = sample_rows(self.logits, self.rows, live)
        next_tokens = [self.pad_id] * len(self.rows)
        for index, token, logprob in zip(live, tokens, logprobs, strict=True):
            row = self.rows[index]
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            next_tokens[index] = token
            if row.cancelled():  # nobody waits for it any more: it leaves without an answer
                pass
            elif token in row.params.stop_token_ids:
                row.finish(STOP)
            elif len(row.token_ids) >= row.params.max_new_tokens:
                row.finish(LENGTH)
            else:
                continue
            self.rows[index] = None
        n_live = sum(row is not None for row in self.rows)
        if n_live == 0:
            self.clear()
            return
        if len(self.rows) - n_live > n_live // 4:  # enough rows have ended: rebuild without them
            keep = [index for index, row in enumerate(self.rows) if row is not None]
            self._compact(keep)
            next_tokens = [next_tokens[index] for index in keep]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        cache = Cache(layers=self.layers)
        out = self.model(input_ids=torch.tensor(next_tokens, device=self.device).unsqueeze(-1),
                         attention_mask=self.mask, position_ids=self.next_positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.logits = out.logits[:, -1]
        self.next_positions = self.next_positions + 1

    def _compact(self, keep: list[int]) -> None:
        """Keep only rows `keep` (live), cut to the columns they use."""
        width = max(len(self.rows[i].prompt) + len(self.rows[i].token_ids) - 1 for i in keep)  # in the cache
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        start = self.used - width
        self.layers = [_BufferLayer(_widen(layer.buffer_keys[index, :, start:self.used], width + HEADROOM),
                                    _widen(layer.buffer_values[index, :, start:self.used], width + HEADROOM), width)
                       for layer in self.layers]
        self.mask = self.mask[index, start:]
        self.next_positions, self.logits = self.next_positions[index], self.logits[index]
        self.rows = [self.rows[i] for i in keep]

    def fail(self, error: BaseException) -> None:
        """Every live row ends with `error`."""
        for row in self.live:
            row.settle(error)
        self.clear()

    def clear(self) -> None:
        self.rows, self.layers, self.logits = [], [], None
        self.mask = self.mask[:0, :0]
        self.next_positions = self.next_positions[:0]


def sample_rows(logits: torch.Tensor, rows: Sequence[DecodeRequest | None],
                live: Sequence[int]) -> tuple[list[int], list[float]]:
    """The next token of each row of `live` (from its own generator) and its behaviour log-prob, in
    the order of `live`; rows are sampled in groups of equal (temperature, top_p). logits (B, V)."""
    groups: dict[tuple[float, float], list[int]] = {}
    for position, index in enumerate(live):
        params = rows[index].params
        groups.setdefault((params.temperature, params.top_p), []).append(position)
    tokens = torch.empty(len(live), dtype=torch.long, device=logits.device)
    picked = torch.empty(len(live), dtype=torch.float32, device=logits.device)
    every = len(live) == logits.shape[0]
    for (temperature, top_p), positions in groups.items():
        whole = every and len(positions) == len(live)
        index = slice(None) if whole else torch.tensor(positions, device=logits.device)
        group_logits = logits if whole else logits[torch.tensor([live[p] for p in positions], device=logits.device)]
        logprobs = sampling_logprobs(group_logits, temperature, top_p)  # (G, V)
        if temperature == 0:
            drawn = group_logits.argmax(dim=-1)
        else:
            uniforms = torch.cat([torch.rand(1, generator=rows[live[p]].generator) for p in positions])  # (G,)
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
        self._closed = False
        self.steps = 0  # decode steps taken (one token for every row of the batch)
        self.rows_stepped = 0  # sum over steps of the rows in the batch: mean batch = rows / steps

    def submit(self, request: DecodeRequest) -> None:
        if self._closed:
            request.settle(RuntimeError("the torch backend was closed"))
            return
        self._ensure_running()
        self._inbox.put(request)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the decoding thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            future.set_exception(RuntimeError("the torch backend was closed"))
            return future
        self._ensure_running()
        self._inbox.put(_Call(fn, future))
        return future

    def close(self) -> None:
        """End the thread; requests and calls still waiting or running fail."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._inbox.put(_STOP)
        if thread is not None:
            thread.join()
        self._take(block=False, waiting=deque(), closing=True)  # what came in after the stop

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="torch-decode", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        batch: DecodeBatch | None = None
        waiting: deque[DecodeRequest] = deque()
        while True:
            idle = batch is None or not batch.rows
            if self._take(block=idle and not waiting, waiting=waiting):  # stop
                error = RuntimeError("the torch backend was closed")
                if batch is not None:
                    batch.fail(error)
                for request in waiting:
                    request.settle(error)
                self._take(block=False, waiting=deque(), closing=True)
                return
            if batch is None or not batch.rows:
                batch = self.new_batch()  # on the model as it is now (weights adopted since the last batch)
            admitted = self._admissible(batch, waiting)
            try:
                batch.admit(admitted)
                self.steps += bool(batch.rows)
                self.rows_stepped += len(batch.live)
                batch.step()
            except Exception as error:  # every row of this batch shared the forward that failed
                log.exception("torch decode step failed; its %d requests end with the error", len(batch.live))
                for request in admitted:
                    request.settle(error)  # once: those already answered are left alone
                batch.fail(error)

    def _take(self, block: bool, waiting: deque, closing: bool = False) -> bool:
        """Move what the inbox holds to `waiting` (requests) or run it (calls); True to stop.
        `closing`: fail everything instead (the thread has stopped)."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return False
            block = False
            if item is _STOP:
                return True
            if closing:
                error = RuntimeError("the torch backend was closed")
                if isinstance(item, _Call):
                    if item.future.set_running_or_notify_cancel():
                        item.future.set_exception(error)
                else:
                    item.settle(error)
            elif isinstance(item, _Call):
                _run_call(item)
            elif not item.cancelled():
                waiting.append(item)

    def _admissible(self, batch: DecodeBatch, waiting: deque) -> list[DecodeRequest]:
        """The waiting requests that fit now, oldest first (one always, into an empty batch)."""
        admitted: list[DecodeRequest] = []
        while waiting and waiting[0].cancelled():
            waiting.popleft()
        while waiting and len(batch.live) + len(admitted) < self.max_rows:
            longest = max([len(waiting[0].prompt)] + [len(r.prompt) for r in admitted])
            if (batch.live or admitted) and batch.cost_with(longest, len(admitted) + 1) > self.max_tokens:
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
