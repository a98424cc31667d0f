"""What `cleaner show` and `cleaner ui` read about one rollout, read-only: the rollout, its segments,
its purified rows under every stored config, and the tokenizer that decodes them.

Design decisions:
- Loading is the warehouse's own (`Warehouse.read_rollout`, `read_purified_of`, `collect_config`,
  `eval_config`); `load_inspection` only assembles what they return. A rollout of an evaluation
  (docs/architecture.md §12) is found the same way; it has no purified rows.
- Text is decoded with the tokenizer of the policy that collected the iteration or ran the
  evaluation (its config's "model"), loaded with `local_files_only=True`: showing a rollout never
  downloads anything. Without a tokenizer the stored segment texts stand in, and the note says so.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from cleaner.engine.saar.walk import Decode
from cleaner.records import PurifiedRow, PurifyConfigRow, Rollout, Segment

logger = logging.getLogger(__name__)


class Panels(StrEnum):
    """Which views `cleaner show` prints (here, not in show.py, so the CLI's option loads no
    polars at start-up)."""

    RAW = "raw"
    PURIFIED = "purified"
    BOTH = "both"


@dataclass(frozen=True)
class ConfigOutcome:
    """This rollout's purified row under one stored purify config."""

    config_id: str
    gamma: float | None  # None if the config row is missing
    rollback_prob: float | None
    similarity_on: str | None
    purify_when: str | None
    rolled_back: bool
    n_shallow: int
    n_deep: int
    n_unrecovered: int
    tokens_removed: int
    reward: float
    advantage: float
    edit: str | None = None  # replace | mask; None if the config row is missing
    n_negatives: int = 0  # the config's negative samples of this rollout (--negative-samples), not rows of their own here


@dataclass(frozen=True)
class Inspection:
    """Everything `cleaner show` prints about one rollout."""

    rollout: Rollout | None  # None if only its segments are committed (should not happen)
    segments: tuple[Segment, ...]  # in seq order
    configs: tuple[ConfigOutcome, ...]  # its purified rows, one per stored config
    model: str | None  # the policy that collected the iteration (or ran the evaluation), from its config
    eval_id: str | None = None  # the evaluation the rollout belongs to; None for a collected one
    rows: tuple[tuple[PurifiedRow, PurifyConfigRow | None], ...] = ()  # the purified rows behind `configs`, with their configs

    @property
    def iteration(self) -> int:
        return self.rollout.iteration if self.rollout is not None else self.segments[0].iteration


def load_inspection(warehouse, rollout_id: str, connection=None) -> Inspection | None:
    """Read one rollout, its segments and purified rows (None if it has no segments).

    `warehouse` is a `cleaner.warehouse.Warehouse` (passed in: the reads are the warehouse's), and
    `connection` one of its `connect()` connections to read over (default: a new one per read);
    WarehouseError propagates.
    """
    rollout, segments = warehouse.read_rollout(rollout_id, connection)
    if not segments:
        return None
    iteration = rollout.iteration if rollout is not None else segments[0].iteration
    eval_config = warehouse.eval_config(rollout.collect_config_id) if rollout is not None else None
    if eval_config is not None:  # an evaluation's rollout: never purified for training
        return Inspection(rollout, tuple(segments), (), _collect_model(eval_config, iteration),
                          rollout.collect_config_id)
    stored = warehouse.read_purified_of(rollout_id, iteration, connection)
    negatives = Counter(row.config_id for row, _ in stored if row.is_negative)
    rows = tuple((row, config) for row, config in stored if not row.is_negative)
    configs = tuple(_outcome(row, config, negatives[row.config_id]) for row, config in rows)
    return Inspection(rollout, tuple(segments), configs, _collect_model(warehouse.collect_config(iteration), iteration),
                      rows=rows)


def _outcome(row: PurifiedRow, config: PurifyConfigRow | None, n_negatives: int) -> ConfigOutcome:
    return ConfigOutcome(
        config_id=row.config_id, gamma=None if config is None else config.gamma,
        rollback_prob=None if config is None else config.rollback_prob,
        similarity_on=None if config is None else config.similarity_on,
        purify_when=None if config is None else config.purify_when,
        edit=None if config is None else config.edit, rolled_back=row.rolled_back,
        n_shallow=row.n_shallow, n_deep=row.n_deep, n_unrecovered=row.n_unrecovered,
        tokens_removed=row.tokens_removed, reward=row.reward, advantage=row.advantage, n_negatives=n_negatives,
    )


def _collect_model(config_json: str | None, iteration: int) -> str | None:
    """The `model` of an iteration's saved collect config, if any."""
    if config_json is None:
        return None
    try:
        model = json.loads(config_json).get("model")
    except (json.JSONDecodeError, AttributeError):
        logger.warning("collect config of iteration %d is not a JSON object; ignoring it", iteration)
        return None
    return model if isinstance(model, str) else None


@dataclass(frozen=True)
class Decoder:
    """How token ids become text in `cleaner show`."""

    decode: Decode | None  # None: fall back to the stored segment texts
    note: str  # said under the purified view: where its text comes from


def load_decoder(model: str | None) -> Decoder:
    """The collecting policy's tokenizer (local files only), or the segment-text fallback."""
    if model is None:
        return Decoder(None, "no collect config for this iteration: text below is the stored segment "
                             "text, not decoded tokens")
    try:
        # transformers costs start-up time: imported only when decoding is asked for
        from transformers import AutoTokenizer  # (start-up time)

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return Decoder(None, f"tokenizer of {model} could not be loaded ({reason}): text below is the "
                             "stored segment text, not decoded tokens")

    def decode(token_ids: Sequence[int]) -> str:
        return tokenizer.decode(list(token_ids), skip_special_tokens=False)

    return Decoder(decode, f"text decoded from the purified token ids with the tokenizer of {model}")
