"""SAAR's IS gate (docs/architecture.md §4): whether a merge is close enough to on-policy to keep.

Design decisions:
- The IS gate (the authors' follow-up, "Plan B"; `RenderSettings.rollback_is_threshold` tau > 0): a merge takes
  tokens R from a_i (its call tokens for a shallow merge, the whole turn for a deep one). Its
  IS = exp(sum log pi_old(R | the rendered context without the error) - sum log pi_b(R | the
  context R was sampled in)). The behaviour sum comes from the stored log-probs; the old-policy
  sum from a `LogprobOracle`. IS < tau rejects the merge: the chain renders raw from there (the
  turn built so far, then every later segment of the chain as collected: failed attempts, errors
  and retries all kept and trained, fully on-policy); later chains are still purified. An oracle
  that does not know a sum yet returns None: the merge is kept for now and the rendering marked
  provisional, so the caller can score the pending requests and render again.
- `per_token` (rollback_is_mode = mean) divides the log IS by len(R), the per-token geometric mean the
  authors' later code uses: a sum over a whole turn is dominated by its length, so with the sum
  nearly every merge of a retry that reacts to its error text falls below any tau near 1.
- `ScoreCache` is the oracle the purify pipeline and the agent loop use: renderings ask it, it
  collects what they asked for, and the caller scores every pending request in one scorer call.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class LogprobOracle(Protocol):
    """The old policy's log-probs of some tokens after a context, when known."""

    def logprob_sum(self, context: tuple[int, ...], tokens: tuple[int, ...]) -> float | None:
        """sum_t log pi_old(tokens[t] | context + tokens[:t]); None if not known yet."""
        ...


@dataclass
class Gate:
    """The IS gate of one rendering: threshold, oracle, and whether a decision was assumed."""

    threshold: float
    oracle: LogprobOracle
    per_token: bool = False  # log IS divided by len(R): the per-token (geometric mean) IS
    provisional: bool = False  # some merge was kept only because its IS was not known yet

    def log_is(self, context: tuple[int, ...], tokens: tuple[int, ...],
               behaviour: Sequence[float]) -> float | None:
        old = self.oracle.logprob_sum(context, tokens)
        if old is None:
            self.provisional = True
            return None
        log_ratio = old - math.fsum(behaviour)
        return log_ratio / max(len(tokens), 1) if self.per_token else log_ratio

    def rejects(self, log_is: float | None) -> bool:
        return log_is is not None and log_is < math.log(self.threshold)


ScoreFn = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[float]]]
AsyncScoreFn = Callable[[Sequence[Sequence[int]], Sequence[int]], Awaitable[list[list[float]]]]


class ScoreCache:
    """Scores of (sequence, start) requests, and the requests still wanted; a LogprobOracle.

    The purify pipeline and the agent loop render, send what is pending to their scorer
    (`score_rows` of the prefix-trie scorer, or a backend's `score`) in ONE call, and render again
    while a rendering is provisional. Requests are keyed by their tokens, so every rendering that
    needs the same (context, tokens) shares one score, across rows, configs and rounds.
    """

    def __init__(self) -> None:
        self.scores: dict[tuple[tuple[int, ...], int], tuple[float, ...]] = {}
        self.pending: dict[tuple[tuple[int, ...], int], None] = {}  # insertion-ordered set

    def logprob_sum(self, context: tuple[int, ...], tokens: tuple[int, ...]) -> float | None:
        found = self.get(context + tokens, len(context))
        return None if found is None else math.fsum(found)

    def get(self, token_ids: tuple[int, ...], start: int) -> tuple[float, ...] | None:
        """[log pi(token_ids[t] | token_ids[:t]) for t >= start], or None (and it is wanted)."""
        key = (token_ids, start)
        found = self.scores.get(key)
        if found is None:
            self.pending[key] = None
        return found

    def fill(self, score: ScoreFn) -> int:
        """Score every pending request in one call; returns how many were scored."""
        keys = list(self.pending)
        if keys:
            self._store(keys, score([key[0] for key in keys], [key[1] for key in keys]))
        return len(keys)

    async def fill_async(self, score: AsyncScoreFn) -> int:
        """`fill` with a scorer that is awaited (the agent loop's, one rollout's requests)."""
        keys = list(self.pending)
        if keys:
            self._store(keys, await score([key[0] for key in keys], [key[1] for key in keys]))
        return len(keys)

    def _store(self, keys: list[tuple[tuple[int, ...], int]], results: list[list[float]]) -> None:
        if len(results) != len(keys):
            raise ValueError(f"scorer returned {len(results)} results for {len(keys)} sequences")
        for key, result in zip(keys, results, strict=True):
            if len(result) != len(key[0]) - key[1]:
                raise ValueError(f"scorer returned {len(result)} logprobs for {len(key[0]) - key[1]} "
                                 f"tokens after position {key[1]}")
            self.scores[key] = tuple(float(value) for value in result)
            self.pending.pop(key, None)
