"""Continuous batching for the torch backend: requests join and leave a running decode batch
(docs/architecture.md §6).

Design decisions:
- A `DecodeBatch` holds the rows decoding together in slots: one KV buffer per layer, (S, H, C, D)
  for S slots of C columns, used as a ring. Every step writes its column (`end % C`) in place for
  every slot; a slot's row owns the C columns most recently written, and its attention mask (S, C)
  marks which of them hold its tokens (attention does not care in which order its keys lie: each
  already carries its position, and every forward passes explicit position ids).
- A row's slot has room for its row's largest possible length (prompt + limit): C is at least the
  largest of them, so a row never outgrows its ring, and the batch's memory (S x C positions) is
  known before a row is admitted; `DecodeServer` admits within `max_tokens` such positions. No step
  ever allocates.
- Joining: the new rows are prefilled together (one left-padded forward of their own) and their
  keys and values written into free slots; the rows already decoding are not copied. Only when the
  batch has too few slots or too short a ring is it re-laid into larger buffers. A prefill that
  fails answers only the rows that were joining.
- Leaving: a row that ends frees its slot at once, for the next row to join in place; free slots
  left over once the waiting rows have joined, more than a quarter of the live ones, are compacted
  away (the live slots copied into fewer: every slot is stepped). A step attends over the ring's
  last columns, as many as its longest row holds (a view, where they lie in one run of the ring),
  so attention costs what the rows hold, not what they may grow to.
- Each row samples from its own CPU generator, one uniform per token (inverse CDF), so the tokens a
  row draws depend on its seed and its logits only, never on its neighbours' randomness. The floats
  of a batched forward do depend on the batch's shape in the last bits (this backend is not
  batch-invariant: measured up to ~3e-6 in a log-prob on the tiny policy), so a token can differ
  between two batchings only where its uniform falls that close to a CDF boundary.
- A step is a sampling, then a forward of the sampled tokens. A forward that runs out of device
  memory fails no row: the most recently admitted half of the rows is retracted (their requests
  start again later from their prompts, with their seeds: the same samples), the batch admits no
  more rows than it kept until it empties, and the forward is tried again; only a row alone that
  does not fit fails. Any other exception of a forward fails the rows that shared it, and only them.
- `run_to_end` is the batch API's engine: every request admitted at once, stepped until all end, in
  the caller's thread. `DecodeServer` runs a batch on a thread of its own and takes requests from
  any thread at any time: each step first admits what is waiting, then samples one token for every
  row, so a request waits at most one step to join. Other work on the model (the IS gate's
  scoring) runs on that thread between steps, so two forwards never share the model at once.
- Nothing waits forever: whatever the decoding thread raises outside a forward (a bug, a device that
  is lost) answers every request it holds, waiting or running, with that error, and every later
  request at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from cleaner.engine.model.base import LENGTH, STOP, Generation, SamplingParams
from cleaner.engine.model.kv import KV, cache_argument, causal_forward

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 256  # rows decoding at once (SGLang's max_running_requests plays this part)
DEFAULT_MAX_TOKENS = 262_144  # positions of cache (slots x ring), each row counted at prompt + limit: 256 rows of 1,024


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

    def restart(self) -> None:
        """Back to its prompt and the start of its seed's stream (a retracted row samples again)."""
        self.token_ids.clear()
        self.logprobs.clear()
        self.generator = torch.Generator().manual_seed(int(self.seed))

    @property
    def longest(self) -> int:
        """Positions its row may take: its prompt and its limit."""
        return len(self.prompt) + max(self.params.max_new_tokens, 0)

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


class _RingLayer(DynamicLayer):
    """One layer's keys and values, (S, H, C, D): a forward writes its one column at `column` in
    place and attends over the columns `window` (a view, no copy), under the batch's mask."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.column = 0
        self.window = slice(None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys[:, :, self.column] = key_states[:, :, -1]
        self.values[:, :, self.column] = value_states[:, :, -1]
        return self.keys[:, :, self.window], self.values[:, :, self.window]

    def get_seq_length(self) -> int:
        return self.keys.shape[2]


def _relaid(buffer: torch.Tensor, end: int, slots: int, columns: int) -> torch.Tensor:
    """`buffer` (S, ..., C, ...) on its column axis 2 (or 1 for a mask (S, C)) copied into `slots`
    slots of a `columns`-column ring: the last C columns written keep their places modulo the new
    ring (new slots and columns zero)."""
    axis = 2 if buffer.dim() == 4 else 1
    old = buffer.shape[axis]
    shape = list(buffer.shape)
    shape[0], shape[axis] = slots, columns
    wider = buffer.new_zeros(shape)
    written = torch.arange(end - old, end, device=buffer.device)  # the last C columns, oldest first
    source, target = written % old, written % columns
    if axis == 2:
        wider[:buffer.shape[0], :, target] = buffer[:, :, source]
    else:
        wider[:buffer.shape[0], target] = buffer[:, source]
    return wider


class DecodeBatch:
    """Rows decoding together on one model, in the slots of a ring cache (see the module's notes)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[DecodeRequest | None] = []  # per slot; None: free
        self.layers: list[_RingLayer] = []
        self.mask = torch.zeros((0, 0), dtype=torch.bool, device=device)  # (S, C): the slot's row's tokens
        self.next_positions = torch.zeros((0, 1), dtype=torch.long, device=device)  # (S, 1)
        self.logits: torch.Tensor | None = None  # (S, V): each row's next-token distribution
        self.end = 0  # columns written so far: the next step writes column end % C
        self.pending: list[int] | None = None  # tokens sampled for each slot, not yet forwarded
        self.order: list[int] = []  # per slot: when its row joined (retraction takes the latest)
        self.joins = 0

    @property
    def live(self) -> list[DecodeRequest]:
        return [row for row in self.rows if row is not None]

    @property
    def columns(self) -> int:
        """C: the ring's length."""
        return self.mask.shape[1]

    def shape_with(self, requests: Sequence[DecodeRequest]) -> tuple[int, int]:
        """(slots, columns) the batch needs to take `requests` besides the rows it has: a slot each,
        and a ring as long as the longest any of its rows may grow to."""
        free = len(self.rows) - len(self.live)
        slots = len(self.rows) + max(0, len(requests) - free)
        return slots, max([self.columns] + [request.longest for request in requests])

    @torch.inference_mode()
    def admit(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill `requests` in one forward and write them into free slots (the batch is re-laid
        first only if it has too few slots or too short a ring). Raises, the batch untouched, if
        the prefill or the re-laying does."""
        if self.pending is not None:
            raise RuntimeError("admit between steps only: a forward is pending")
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
        slots, columns = self.shape_with(ready)
        if slots > len(self.rows) or columns > self.columns:
            self._relay(slots, columns, out.kv, out.logits[:1, -1])
            if not any(self.rows):  # a new batch: its prompts end where the ring's first run begins
                self.end = mask.shape[1]  # (so the steps' windows lie in one run until the ring wraps)
        free = [slot for slot, row in enumerate(self.rows) if row is None]
        width, ring = mask.shape[1], self.columns
        for index, (request, slot) in enumerate(zip(ready, free, strict=False)):
            length = len(request.prompt)
            columns_of = torch.arange(self.end - length, self.end, device=self.device) % ring  # ending at end - 1
            for layer, (keys, values) in zip(self.layers, out.kv, strict=True):
                layer.keys[slot, :, columns_of] = keys[index, :, width - length:]
                layer.values[slot, :, columns_of] = values[index, :, width - length:]
            self.mask[slot] = False
            self.mask[slot, columns_of] = True
            self.next_positions[slot] = length
            self.logits[slot] = out.logits[index, -1]
            self.rows[slot] = request
            self.order[slot] = self.joins
            self.joins += 1

    def _relay(self, slots: int, columns: int, kv: KV, logits: torch.Tensor) -> None:
        """Larger buffers: `slots` slots of `columns` columns, the rows decoding kept in theirs.
        `kv` and `logits` (1, V) are a prefill's, for the buffers' shapes and dtypes."""
        if not self.layers:  # the first rows: buffers shaped like their prefill's
            layers = [_RingLayer(keys.new_zeros((slots, keys.shape[1], columns, keys.shape[3])),
                                 values.new_zeros((slots, values.shape[1], columns, values.shape[3])))
                      for keys, values in kv]
            grown_logits = logits.new_zeros((slots, logits.shape[-1]))
        else:
            layers = [_RingLayer(_relaid(layer.keys, self.end, slots, columns),
                                 _relaid(layer.values, self.end, slots, columns)) for layer in self.layers]
            grown_logits = torch.cat([self.logits, self.logits.new_zeros((slots - len(self.rows), self.logits.shape[-1]))])
        self.layers, self.logits = layers, grown_logits  # all allocated: only now is the batch changed
        self.mask = _relaid(self.mask, self.end, slots, columns) if self.columns else \
            torch.zeros((slots, columns), dtype=torch.bool, device=self.device)
        self.next_positions = torch.cat([self.next_positions, self.next_positions.new_zeros((slots - len(self.rows), 1))])
        grow = slots - len(self.rows)
        self.rows += [None] * grow
        self.order += [0] * grow

    @torch.inference_mode()
    def step(self) -> None:
        """Sample one token for every live row (rows that end leave), then forward those tokens.
        After a forward that raised, only the forward is tried again."""
        if self.pending is None:
            if not self.live:
                self.clear()
                return
            self._sample()
        if not self.live:
            self.clear()
            return
        self._forward()

    def _sample(self) -> None:
        live = [index for index, row in enumerate(self.rows) if row is not None]
        tokens, logprobs = sample_rows(self.logits, self.rows, live)
        pending = [self.pad_id] * len(self.rows)
        for index, token, logprob in zip(live, tokens, logprobs, strict=True):
            row = self.rows[index]
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            pending[index] = token
            if row.cancelled():  # nobody waits for it any more: it leaves without an answer
                pass
            elif token in row.params.stop_token_ids:
                row.finish(STOP)
            elif len(row.token_ids) >= row.params.max_new_tokens:
                row.finish(LENGTH)
            else:
                continue
            self._free(index)
        self.pending = pending

    def _forward(self) -> None:
        column = self.end % self.columns
        self.mask[:, column] = True  # each slot's new token (a free slot attends to its own only)
        window = self._window()
        for layer in self.layers:
            layer.column, layer.window = column, window
        input_ids = torch.tensor(self.pending, device=self.device).unsqueeze(-1)  # (S, 1)
        out = self.model(input_ids=input_ids, attention_mask=self.mask[:, window].contiguous()[:, None, None],  # (S, 1, 1, W)
                         position_ids=self.next_positions, use_cache=True, logits_to_keep=1,
                         **{cache_argument(self.model): Cache(layers=self.layers)})
        self.logits = out.logits[:, -1]
        self.next_positions = self.next_positions + 1
        self.end += 1
        self.pending = None

    def _window(self) -> slice:
        """The ring's columns a step attends over: the last ones written, as many as the longest live
        row holds (its tokens and the one written now), where they lie in one run of the buffer;
        else the whole ring. Attention then costs what the rows hold, not what they may grow to."""
        span = max(len(row.prompt) + len(row.token_ids) for row in self.live)  # the new column included
        low = (self.end + 1 - span) % self.columns
        return slice(low, low + span) if low + span <= self.columns else slice(None)

    def _free(self, slot: int) -> None:
        self.rows[slot] = None
        self.mask[slot] = False

    def compact_if_sparse(self) -> None:
        """Drop the free slots once they are more than a quarter of the live ones (every slot is
        stepped): call it after the rows waiting to join have taken what they could."""
        free = len(self.rows) - len(self.live)
        if free and free > len(self.live) // 4:
            self._compact()

    def _compact(self) -> None:
        """Keep only the live slots (a copy of theirs)."""
        keep = [slot for slot, row in enumerate(self.rows) if row is not None]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.mask, self.next_positions, self.logits = self.mask[index], self.next_positions[index], self.logits[index]
        self.pending = None if self.pending is None else [self.pending[slot] for slot in keep]
        self.rows = [self.rows[slot] for slot in keep]
        self.order = [self.order[slot] for slot in keep]

    @torch.inference_mode()
    def retract(self) -> list[DecodeRequest]:
        """Free the most recently admitted half of the live rows (at least one, never the last):
        their requests, restarted, to be admitted again later."""
        live = sorted((slot for slot, row in enumerate(self.rows) if row is not None), key=self.order.__getitem__)
        taken = live[len(live) - len(live) // 2:] if len(live) > 1 else []
        requests = []
        for slot in taken:
            request = self.rows[slot]
            request.restart()
            requests.append(request)
            self._free(slot)
            if self.pending is not None:
                self.pending[slot] = self.pad_id
        return requests

    def fail(self, error: BaseException) -> None:
        """Every live row ends with `error`."""
        for row in self.live:
            row.settle(error)
        self.clear()

    def clear(self) -> None:
        self.rows, self.layers, self.logits, self.order, self.pending = [], [], None, [], None
        self.mask = self.mask[:0, :0]
        self.next_positions = self.next_positions[:0]
        self.end = 0


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
        batch.compact_if_sparse()
        batch.step()


# ---------------------------------------------------------------------------- the decoding thread


@dataclass(frozen=True)
class _ModelWork:
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
        self.broken: BaseException | None = None  # what ended the decoding thread, if anything did
        self._received: weakref.WeakSet[DecodeRequest] = weakref.WeakSet()  # every request taken in (to answer at death)
        self.row_limit: int | None = None  # after running out of memory: rows the batch may hold until it empties
        self.steps = 0  # decode steps taken (one token for every row of the batch)
        self.rows_stepped = 0  # sum over steps of the rows in the batch: mean batch = rows / steps

    def _refusal(self) -> BaseException | None:
        if self.broken is not None:
            return RuntimeError(f"the torch backend's decoding thread died: {type(self.broken).__name__}: "
                                f"{self.broken}")
        return RuntimeError("the torch backend was closed") if self._closed else None

    def submit(self, request: DecodeRequest) -> None:
        if (refusal := self._enqueue(request)) is not None:
            request.settle(refusal)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the decoding thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if (refusal := self._enqueue(_ModelWork(fn, future))) is not None:
            future.set_exception(refusal)
        return future

    def _enqueue(self, item: DecodeRequest | _ModelWork) -> BaseException | None:
        """Put `item` in the inbox for a running thread, or say why not. Under the lock the thread
        takes to record its death or close: an item checked in before either is in the inbox when
        the thread drains it at its end, and one after is refused, so none is left unanswered."""
        with self._lock:
            if (refusal := self._refusal()) is not None:
                return refusal
            self._ensure_running()
            self._inbox.put(item)
        return None

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
        """Start the decoding thread if none runs (the caller holds the lock)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="torch-decode", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        batch: DecodeBatch | None = None
        waiting: deque[DecodeRequest] = deque()
        try:
            while not self._take(block=(batch is None or not batch.rows) and not waiting, waiting=waiting):
                if batch is None or not batch.rows:
                    batch = self.new_batch()  # on the model as it is now (weights adopted since the last batch)
                    self.row_limit = None
                self._admit(batch, waiting)
                self._step(batch, waiting)
            self._end(batch, waiting, RuntimeError("the torch backend was closed"))
        except BaseException as error:  # noqa: BLE001 - the thread itself broke: answer all it holds
            log.exception("the torch backend's decoding thread died")
            with self._lock:  # from here on every request is refused at once (`_enqueue`)
                self.broken = error
            self._end(batch, waiting, self._refusal())

    def _end(self, batch: DecodeBatch | None, waiting: deque, error: BaseException) -> None:
        """Answer every request held here with `error`: running, waiting, and still in the inbox."""
        if batch is not None:
            batch.fail(error)
        for request in [*waiting, *list(self._received)]:  # those between a batch and the queue too
            request.settle(error)  # once: those already answered are left alone
        waiting.clear()
        self._take(block=False, waiting=deque(), closing=True)

    def _admit(self, batch: DecodeBatch, waiting: deque) -> None:
        admitted = self._admissible(batch, waiting)
        try:
            batch.admit(admitted)
        except torch.OutOfMemoryError as error:
            if batch.live or len(admitted) > 1:  # wait for room: no more rows than now, at least one
                waiting.extendleft(reversed(admitted))
                self.row_limit = max(len(batch.live), 1)
                _free_device_memory(batch.device)
            else:
                admitted[0].settle(error)  # one row alone does not fit
        except Exception as error:  # the joining rows' prefill failed: it was theirs alone
            log.exception("a prefill failed; its %d requests end with the error", len(admitted))
            for request in admitted:
                request.settle(error)

    def _step(self, batch: DecodeBatch, waiting: deque) -> None:
        if not batch.rows:
            return
        try:
            if batch.pending is None:
                batch.compact_if_sparse()
            self.steps += 1
            self.rows_stepped += len(batch.live)
            batch.step()
        except torch.OutOfMemoryError as error:
            retracted = batch.retract()
            if not retracted:
                batch.fail(error)  # one row alone does not fit
                return
            log.warning("out of device memory: %d rows wait to start again", len(retracted))
            waiting.extendleft(reversed(retracted))
            self.row_limit = len(batch.live)
            _free_device_memory(batch.device)
        except Exception as error:  # every row of this batch shared the forward that failed
            log.exception("torch decode step failed; its %d requests end with the error", len(batch.live))
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
                error = self._refusal() or RuntimeError("the torch backend was closed")
                if isinstance(item, _ModelWork):
                    if item.future.set_running_or_notify_cancel():
                        item.future.set_exception(error)
                else:
                    item.settle(error)
            elif isinstance(item, _ModelWork):
                _run_call(item)
            elif not item.cancelled():
                self._received.add(item)
                waiting.append(item)

    def _admissible(self, batch: DecodeBatch, waiting: deque) -> list[DecodeRequest]:
        """The waiting requests that fit now, oldest first (one always, into an empty batch): within
        `max_rows` rows and `max_tokens` positions of cache, each row counted at its largest
        possible length (prompt + limit)."""
        admitted: list[DecodeRequest] = []
        while waiting and waiting[0].cancelled():
            waiting.popleft()
        if batch.pending is not None:  # a forward to try again first
            return admitted
        rows = min(self.max_rows, self.row_limit or self.max_rows)
        while waiting and len(batch.live) + len(admitted) < rows:
            slots, columns = batch.shape_with([*admitted, waiting[0]])
            if (batch.live or admitted) and slots * columns > self.max_tokens:
                break
            admitted.append(waiting.popleft())
        return admitted


def _free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_call(call: _ModelWork) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn())
    except BaseException as error:  # handed to the caller, who raises it
        call.future.set_exception(error)
