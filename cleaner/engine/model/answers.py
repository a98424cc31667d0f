"""What an engine's answer must be before anything stores it as the policy's doing
(docs/architecture.md §5, "Faults and load").

A generation is the policy's tokens and their log-probabilities: each id inside the model's
vocabulary, each log-prob a finite number <= 0, as many of each as the engine says it generated,
at least one and no more than the request allowed. A score is a log-prob per scored token, finite
and <= 0. An answer that breaks any of these is not something the policy did (a server that
misbehaves, a float16 forward that overflowed into NaN or inf): the backend raises `BadAnswer`, an
infrastructure fault, so the rollout is collected again on `--resume` and never trained on.

The same rules read back what a warehouse holds (`stored_value_faults`, `row_value_faults`):
purify and train refuse values an older version stored unchecked, naming the rollouts, instead of
failing deep inside a forward (an id past the embedding) or training on NaN.

Design decisions:
- `LOGPROB_SLACK`: a log-prob may exceed 0 by rounding only. log softmax in float32 rounds within
  ~1e-6 of 0 for a token of probability ~1; 1e-3 also admits an engine that computes it in half
  precision, and still refuses any real positive value (a probability above 1).
- Vocabulary: the model's embedding rows (config `vocab_size`), which is what a forward indexes;
  a tokenizer's own size is often smaller (padded vocabularies), and ids between the two are
  valid inputs that a sampled distribution can give, if rarely.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from cleaner.engine.model.base import BackendError, Generation
from cleaner.records import PurifiedRow, Segment, SegmentKind

LOGPROB_SLACK = 1e-3  # the most a log-prob may exceed 0 by rounding (module notes)
NAMED = 5  # rollouts named in a refusal; the rest are counted


class BadAnswer(BackendError):
    """An engine's answer that cannot be what the policy did: an infrastructure fault."""


def _ids_fault(token_ids: Sequence[int], vocab_size: int | None) -> str | None:
    if vocab_size is None or not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None  # min and max first: a warehouse's hundreds of millions of ids are read at C speed
    position, token = next((p, t) for p, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    return f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"


def _logprobs_fault(logprobs: Sequence[float]) -> str | None:
    if not logprobs or (all(map(math.isfinite, logprobs)) and max(logprobs) <= LOGPROB_SLACK):
        return None
    position, value = next((p, v) for p, v in enumerate(logprobs) if not (math.isfinite(v) and v <= LOGPROB_SLACK))
    return f"log-prob {value!r} at position {position} is not a finite number <= 0"


def generation_fault(generation: Generation, max_new_tokens: int, vocab_size: int | None,
                     reported_length: int | None = None) -> str | None:
    """Why `generation` cannot be the policy's answer to a request of `max_new_tokens`, or None.
    `reported_length`: how many tokens the engine says it generated, where it says."""
    ids, logprobs = generation.token_ids, generation.logprobs
    if len(ids) != len(logprobs):
        return f"{len(ids)} token ids but {len(logprobs)} log-probs"
    if reported_length is not None and reported_length != len(ids):
        return f"the engine reports {reported_length} generated tokens but sent {len(ids)}"
    if not ids:
        return f"no token generated (finish reason {generation.finish_reason!r}); a generation ends on a token"
    if len(ids) > max_new_tokens:
        return f"{len(ids)} tokens generated where at most {max_new_tokens} were asked for"
    return _ids_fault(ids, vocab_size) or _logprobs_fault(logprobs)


def checked_generation(generation: Generation, max_new_tokens: int, vocab_size: int | None,
                       reported_length: int | None = None) -> Generation:
    """`generation`, or BadAnswer saying what is wrong with it."""
    fault = generation_fault(generation, max_new_tokens, vocab_size, reported_length)
    if fault is not None:
        raise BadAnswer(f"the engine's generation is not a policy's: {fault}")
    return generation


def checked_scores(scores: Sequence[float], expected: int) -> list[float]:
    """Scored log-probs of `expected` tokens, or BadAnswer."""
    if len(scores) != expected:
        raise BadAnswer(f"the engine scored {len(scores)} tokens where {expected} were asked for")
    fault = _logprobs_fault(scores)
    if fault is not None:
        raise BadAnswer(f"the engine's scores are not log-probs: {fault}")
    return list(scores)


def checked_score_rows(scores: Sequence[Sequence[float]], sequences: Sequence[Sequence[int]],
                       starts: Sequence[int]) -> list[list[float]]:
    """A score request's answer (row i: the log-probs of sequences[i][starts[i]:]), or BadAnswer."""
    if len(scores) != len(sequences):
        raise BadAnswer(f"the engine answered {len(scores)} score rows to {len(sequences)} asked")
    return [checked_scores(row, len(sequence) - start)
            for row, sequence, start in zip(scores, sequences, starts, strict=True)]


# ---------------------------------------------------------------------------- stored values


def segment_fault(segment: Segment, vocab_size: int | None) -> str | None:
    """Why a stored segment holds what no policy produced, or None."""
    fault = _ids_fault(segment.token_ids, vocab_size)
    if fault is None and segment.kind == SegmentKind.ASSISTANT:
        if segment.logprobs is None or len(segment.logprobs) != len(segment.token_ids):
            fault = "its behaviour log-probs do not match its tokens"
        else:
            fault = _logprobs_fault(segment.logprobs)
        if fault is None and not segment.token_ids:
            fault = "an assistant turn without a token"
    return None if fault is None else f"seq {segment.seq}: {fault}"


def row_fault(row: PurifiedRow, vocab_size: int | None) -> str | None:
    """Why a stored purified row cannot be trained on, or None (a row an infrastructure fault
    ended is never trained: its values are not read)."""
    if row.infra_fault:
        return None
    fault = _ids_fault(row.token_ids, vocab_size)
    advantages = (row.advantage, row.reward, *(row.token_advantages or ()))
    if fault is None and not all(math.isfinite(value) for value in advantages):
        fault = f"a reward or advantage that is not finite (advantage {row.advantage!r}, reward {row.reward!r})"
    for name, values in (("behaviour", row.behavior_logprobs), ("old", row.old_logprobs)):
        if fault is None:
            trained = [value for value, mask in zip(values, row.loss_mask, strict=True) if mask]
            fault = _logprobs_fault(trained)
            fault = None if fault is None else f"{name} {fault} among the trained tokens"
    return fault


def refusal(faults: dict[str, str], what: str) -> str | None:
    """One line naming the rollouts whose `what` is faulty (the first few, and a count), or None."""
    if not faults:
        return None
    named = "; ".join(f"{rollout_id} ({fault})" for rollout_id, fault in list(faults.items())[:NAMED])
    more = f" and {len(faults) - NAMED} more" if len(faults) > NAMED else ""
    return f"{len(faults)} rollout(s) hold {what} no policy produced: {named}{more}"


def stored_value_faults(segments: Iterable[Segment], vocab_size: int | None) -> dict[str, str]:
    """{rollout id: its first faulty segment} over stored segments."""
    return _first_faults(segments, lambda segment: segment_fault(segment, vocab_size))


def row_value_faults(rows: Iterable[PurifiedRow], vocab_size: int | None) -> dict[str, str]:
    """{rollout id: what is wrong} over stored purified rows."""
    return _first_faults(rows, lambda row: row_fault(row, vocab_size))


def _first_faults(records: Iterable[Segment | PurifiedRow], fault_of) -> dict[str, str]:
    """{rollout id: the first fault `fault_of` finds in its records}, in the records' order."""
    faults: dict[str, str] = {}
    for record in records:
        if record.rollout_id not in faults and (fault := fault_of(record)) is not None:
            faults[record.rollout_id] = fault
    return faults
