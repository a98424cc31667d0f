"""Arrow schemas of the warehouse (docs/architecture.md §3), written once, here and nowhere else.

Each dataset pairs an Arrow schema with the frozen record type whose fields are its columns
(`cleaner.records`), and the Hive partition keys its part files live under. Conversion
between records and Arrow tables is generic over that pairing, so a column is named exactly once:
as a record field, typed here.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from cleaner import records

_TOKENS = pa.list_(pa.int32())
_FLOATS = pa.list_(pa.float32())
_TIME = pa.timestamp("us")


@dataclass(frozen=True)
class Dataset:
    name: str  # directory under the warehouse root, and the DuckDB view name
    record: type  # the frozen dataclass whose fields are the columns
    schema: pa.Schema
    partition_keys: tuple[str, ...]  # Hive partition directories, outermost first
    # Columns added after parts were written, with the value a part without them reads as (None:
    # null); every other column is required (docs/architecture.md §3).
    added: tuple[tuple[str, object], ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.schema.names)


ROLLOUTS = Dataset("rollouts", records.Rollout, pa.schema([
    ("rollout_id", pa.string()), ("iteration", pa.int32()), ("group_id", pa.string()),
    ("prompt_id", pa.string()), ("sample_index", pa.int32()), ("policy_version", pa.string()),
    ("data_source", pa.string()), ("ground_truth", pa.string()), ("answer", pa.string()),
    ("reward", pa.float32()), ("correct", pa.bool_()), ("finish_reason", pa.string()),
    ("rollback_draw", pa.float32()), ("collect_view", pa.string()), ("collect_config_id", pa.string()),
    ("n_assistant_segments", pa.int32()), ("n_tool_calls", pa.int32()), ("n_failed_calls", pa.int32()),
    ("created_at", _TIME), ("reward_details", pa.string()),
]), ("iteration",), added=(("reward_details", None),))

SEGMENTS = Dataset("segments", records.Segment, pa.schema([
    ("rollout_id", pa.string()), ("iteration", pa.int32()), ("seq", pa.int32()), ("kind", pa.string()),
    ("step", pa.int32()), ("attempt", pa.int32()), ("token_ids", _TOKENS), ("logprobs", _FLOATS),
    ("text", pa.string()), ("call_start", pa.int32()), ("tool_code", pa.string()),
    ("tool_status", pa.string()), ("error_type", pa.string()), ("exec_ms", pa.float32()),
    ("tool_name", pa.string()),
]), ("iteration",), added=(("tool_name", None),))

PURIFIED = Dataset("purified", records.PurifiedRow, pa.schema([
    ("config_id", pa.string()), ("iteration", pa.int32()), ("rollout_id", pa.string()),
    ("group_id", pa.string()), ("token_ids", _TOKENS), ("prompt_len", pa.int32()),
    ("loss_mask", pa.list_(pa.int8())), ("behavior_logprobs", _FLOATS), ("old_logprobs", _FLOATS),
    ("reward", pa.float32()), ("advantage", pa.float32()), ("rolled_back", pa.bool_()),
    ("n_shallow", pa.int32()), ("n_deep", pa.int32()), ("n_unrecovered", pa.int32()),
    ("tokens_removed", pa.int32()), ("scorer_version", pa.string()), ("infra_fault", pa.bool_()),
    ("n_gated", pa.int32()), ("negative_seq", pa.int32()), ("token_advantages", _FLOATS),
    ("dropped", pa.bool_()), ("void_turn", pa.bool_()),
]), ("iteration", "config"), added=(("dropped", False), ("void_turn", False)))

# gamma and p are parameters a user typed: float64 reads them back exactly (float32 would turn 0.3
# into 0.30000001192092896).
PURIFY_CONFIGS = Dataset("purify_configs", records.PurifyConfigRow, pa.schema([
    ("config_id", pa.string()), ("gamma", pa.float64()), ("rollback_prob", pa.float64()),
    ("similarity_on", pa.string()), ("purify_when", pa.string()), ("params_json", pa.string()),
    ("created_at", _TIME), ("edit", pa.string()),
]), (), added=(("edit", "replace"),))

ITERATIONS = Dataset("iterations", records.IterationRow, pa.schema([
    ("iteration", pa.int32()), ("policy_in", pa.string()), ("policy_out", pa.string()),
    ("collect_config_json", pa.string()), ("purify_config_json", pa.string()),
    ("train_config_json", pa.string()), ("collect_s", pa.float32()), ("purify_s", pa.float32()),
    ("train_s", pa.float32()), ("accuracy", pa.float32()), ("first_attempt_error_rate", pa.float32()),
    ("failures_per_trajectory", pa.float32()), ("n_shallow", pa.int32()), ("n_deep", pa.int32()),
    ("created_at", _TIME),
    ("clean_rollouts", pa.int32()), ("clean_accuracy", pa.float32()), ("clean_advantage", pa.float32()),
    ("recovered_rollouts", pa.int32()), ("recovered_accuracy", pa.float32()),
    ("recovered_advantage", pa.float32()), ("unrecovered_rollouts", pa.int32()),
    ("unrecovered_accuracy", pa.float32()), ("unrecovered_advantage", pa.float32()), ("n_gated", pa.int32()),
    ("failed_call_tokens", pa.int32()), ("failed_call_advantage", pa.float32()),
    ("failed_call_positive_share", pa.float32()),
]), (), added=(("failed_call_tokens", None), ("failed_call_advantage", None), ("failed_call_positive_share", None)))

TRAIN_STEPS = Dataset("train_steps", records.TrainStepRow, pa.schema([
    ("iteration", pa.int32()), ("step", pa.int32()), ("optimizer_step", pa.int32()), ("loss", pa.float32()),
    ("clip_fraction", pa.float32()), ("approx_kl", pa.float32()), ("entropy", pa.float32()),
    ("grad_norm", pa.float32()), ("lr", pa.float32()), ("tokens", pa.int32()), ("created_at", _TIME),
    ("config_id", pa.string()), ("checkpoint", pa.string()), ("seconds", pa.float32()), ("mfu", pa.float32()),
    ("rollout_corr", pa.string()), ("pg_loss", pa.float32()), ("kl_loss", pa.float32()), ("ppo_kl", pa.float32()),
    ("clip_fraction_lower", pa.float32()), ("train_config_id", pa.string()),
]), ("iteration",), added=(("config_id", None), ("checkpoint", None), ("seconds", None), ("mfu", None),
                           ("rollout_corr", None), ("pg_loss", None), ("kl_loss", None), ("ppo_kl", None),
                           ("clip_fraction_lower", None), ("train_config_id", None)))

# Evaluation (docs/architecture.md §12): the same rows as collection, partitioned by the eval id
# (their `collect_config_id`), so `cleaner show` and every query over trajectories work on them.
EVAL_ROLLOUTS = Dataset("eval_rollouts", records.Rollout, ROLLOUTS.schema, ("eval",), ROLLOUTS.added)
EVAL_SEGMENTS = Dataset("eval_segments", records.Segment, SEGMENTS.schema, ("eval",), SEGMENTS.added)

EVAL_RUNS = Dataset("eval_runs", records.EvalRunRow, pa.schema([
    ("eval_id", pa.string()), ("model", pa.string()), ("policy_version", pa.string()),
    ("dataset", pa.string()), ("data_path", pa.string()), ("data_source", pa.string()),
    ("prompt_style", pa.string()), ("saar", pa.bool_()), ("n", pa.int32()), ("problems", pa.int32()),
    ("rollouts", pa.int32()), ("avg_at_n", pa.float64()), ("pass_at_k", pa.map_(pa.int32(), pa.float64())),
    ("maj_at_n", pa.float64()), ("tool_calls_per_trajectory", pa.float64()),
    ("failures_per_trajectory", pa.float64()), ("first_call_error_rate", pa.float64()),
    ("recovery_rate", pa.float64()), ("seconds", pa.float64()), ("rollouts_generated", pa.int32()),
    ("seed", pa.int64()), ("temperature", pa.float64()), ("top_p", pa.float64()), ("max_turns", pa.int32()),
    ("config_json", pa.string()), ("created_at", _TIME),
]), ())

DATASETS: dict[str, Dataset] = {
    d.name: d for d in (ROLLOUTS, SEGMENTS, PURIFIED, PURIFY_CONFIGS, ITERATIONS, TRAIN_STEPS,
                        EVAL_ROLLOUTS, EVAL_SEGMENTS, EVAL_RUNS)
}

# Each segments dataset and the rollouts dataset whose parts commit it (the commit protocol).
COMMITTED_BY = {SEGMENTS.name: ROLLOUTS, EVAL_SEGMENTS.name: EVAL_ROLLOUTS}


def _check_record_fields(dataset: Dataset) -> None:
    fields = tuple(f.name for f in dataclasses.fields(dataset.record))
    if fields != dataset.columns:
        raise AssertionError(f"{dataset.name}: record fields {fields} != schema columns {dataset.columns}")


for _dataset in DATASETS.values():
    _check_record_fields(_dataset)
    assert {name for name, _ in _dataset.added} <= set(_dataset.columns), _dataset.name


# ---------------------------------------------------------------------------------------------
# Records <-> Arrow


def to_table(dataset: Dataset, rows: Sequence[object]) -> pa.Table:
    """Arrow table of `rows` (records of `dataset.record`) in the dataset's schema."""
    for row in rows:
        if not isinstance(row, dataset.record):
            raise TypeError(f"{dataset.name} takes {dataset.record.__name__} rows, got {type(row).__name__}")
    fields = operator.attrgetter(*dataset.columns)  # one C call per row, then transpose
    if len(dataset.columns) == 1:  # attrgetter of one name returns the value, not a 1-tuple
        columns = [tuple(map(fields, rows))]
    else:
        columns = list(zip(*map(fields, rows), strict=True)) if rows else [() for _ in dataset.columns]
    return pa.Table.from_arrays(
        [_column(list(values), f.type) for values, f in zip(columns, dataset.schema, strict=True)],
        schema=dataset.schema,
    )


def _column(values: list, type_: pa.DataType) -> pa.Array:
    """One column; a list column converts each distinct list OBJECT once and repeats it with `take`.

    Purified rows of an ablation grid share their token and log-prob tuples across configs (a raw
    rendering is the same object under every config), and converting Python lists dominates a write.
    """
    if not pa.types.is_list(type_):
        return pa.array(values, type_)
    slots: dict[int, int] = {}
    index = [slots.setdefault(id(value), len(slots)) for value in values]
    if len(slots) == len(values):
        return pa.array(values, type_)
    firsts = list({id(value): value for value in values}.values())  # insertion order = slot order
    return pa.array(firsts, type_).take(pa.array(index, pa.int32()))


def from_table(dataset: Dataset, table: pa.Table) -> list:
    """Records of `dataset.record` from an Arrow table holding at least the dataset's columns."""
    columns = []
    for f in dataset.schema:  # in record field order (checked at import), so rows are positional
        values = table.column(f.name).to_pylist()
        nested = pa.types.is_list(f.type) or pa.types.is_map(f.type)  # a map reads as a list of pairs
        columns.append([None if v is None else tuple(v) for v in values] if nested else values)
    return [dataset.record(*values) for values in zip(*columns, strict=True)]
